// CPU attention kernels. Arguments are validated by the caller.
#pragma once

#include "../common/params.h"

namespace ringflash::cpu {

void attention_forward(const core::AttentionArgs& args);
void attention_backward(const core::AttentionArgs& args);

// The vector ISA the CPU kernels were compiled for, e.g. "avx512".
const char* isa_name();

}  // namespace ringflash::cpu
