#include "attention_cpu.h"
#include "ringflash/errors.h"
namespace ringflash::cpu {
void attention_backward(const core::AttentionArgs&) { throw NotSupported("todo"); }
}
