// hybrid: ulysses inside, ring outside.
#include "ringflash/errors.h"
#include "strategy.h"

namespace ringflash::parallel {

void hybrid_forward(Communicator&, Communicator&, const Problem&, const ParallelOptions&) { throw NotSupported("[hybrid] not implemented yet"); }
void hybrid_backward(Communicator&, Communicator&, const Problem&, const ParallelOptions&) { throw NotSupported("[hybrid] not implemented yet"); }

}  // namespace ringflash::parallel
