// allgather: K/V gathered in slices of heads.
#include "ringflash/errors.h"
#include "strategy.h"

namespace ringflash::parallel {

void allgather_forward(Communicator&, const Problem&, const ParallelOptions&) { throw NotSupported("[allgather] not implemented yet"); }
void allgather_backward(Communicator&, const Problem&, const ParallelOptions&) { throw NotSupported("[allgather] not implemented yet"); }

}  // namespace ringflash::parallel
