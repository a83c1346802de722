// ring, zigzag and stripe: K/V travel around the ring.
#include "ringflash/errors.h"
#include "strategy.h"

namespace ringflash::parallel {

void ring_forward(Communicator&, Layout, const Problem&) { throw NotSupported("[ring] not implemented yet"); }
void ring_backward(Communicator&, Layout, const Problem&) { throw NotSupported("[ring] not implemented yet"); }

}  // namespace ringflash::parallel
