// The communicators that Python holds (comm.cpp), for the other parts of the module.
#pragma once

#include <memory>
#include <vector>

#include "ringflash/comm.h"

namespace ringflash::python {

// ringflash._C.Communicator: shared, because views and split results keep their parents alive.
struct CommHandle {
  std::shared_ptr<Communicator> comm;
};

// A view of `ranks` of `parent` (this rank among them), in that order; no collective.
std::shared_ptr<Communicator> subgroup(const std::shared_ptr<Communicator>& parent, const std::vector<int>& ranks);

// comm->split(color, key), keeping `comm` alive as long as the result.
std::shared_ptr<Communicator> split_shared(const std::shared_ptr<Communicator>& comm, int color, int key);

}  // namespace ringflash::python
