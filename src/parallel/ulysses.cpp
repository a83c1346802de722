// ulysses: all-to-all from sequence shards to head shards and back.
#include "ringflash/errors.h"
#include "strategy.h"

namespace ringflash::parallel {

void ulysses_forward(Communicator&, const Problem&) { throw NotSupported("[ulysses] not implemented yet"); }
void ulysses_backward(Communicator&, const Problem&) { throw NotSupported("[ulysses] not implemented yet"); }

}  // namespace ringflash::parallel
