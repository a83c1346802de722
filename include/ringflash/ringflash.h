// ringflash: exact attention over very long sequences. Umbrella header.
#pragma once

#include "ringflash/attention.h"
#include "ringflash/capabilities.h"
#include "ringflash/errors.h"
#include "ringflash/tensor.h"
