#include "attention_cpu.h"
#include "ringflash/errors.h"
namespace ringflash::cpu {
void attention_forward(const core::AttentionArgs&) { throw NotSupported("todo"); }
const char* isa_name() { return "todo"; }
}
