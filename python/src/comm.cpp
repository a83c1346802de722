// Communicators for Python: the mpi transport, views of rank subsets, and the torch bridge.
//
//   _C.Communicator       a C++ communicator; rank, size, transport, split, subgroup, barrier,
//                         all_gather_bytes, timeout (seconds), stats, fail
//   _C.mpi_world()        every process of the mpiexec job (MPI is initialised on first use)
//   _C.bridge(obj, ...)   a communicator whose messages travel through a Python object (the torch
//                         bridge of ringflash.distributed wraps a torch.distributed process group)
//   _C.nccl_unique_id(), _C.nccl_communicator(id, rank, size, device, timeout), _C.nccl_world(comm, device)
//                         the nccl transport, its id spread by the caller or over another communicator
//
// The bridge object has two methods, called with the GIL held:
//   send_recv(ops) -> handle   ops is a list of (is_send, peer, buffer): peer is a rank of the
//                              bridge's group and buffer a 1-D uint8 torch tensor over the library's
//                              memory (valid until the handle has been waited for); posts them all
//   wait(handle, seconds)      waits for what send_recv posted, raising if `seconds` pass first
// Any exception it raises becomes a CommError that names the op and the rank.
//
// A subgroup is a view of some ranks of its parent: its messages are the parent's messages, with
// ranks translated. It needs no collective to make, so any subset of ranks can make one on its
// own; two views of one parent must not have messages in flight between the same pair of ranks
// at the same time (the strategies never do: a pair of ranks shares at most one of the ulysses and
// ring groups). Every communicator keeps its parent alive.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "comm.h"
#include "ringflash/comm.h"
#include "ringflash/errors.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace ringflash::python {
namespace {

using Clock = std::chrono::steady_clock;

std::string where(const Communicator& comm, const char* op) {
  return "[" + std::string(op) + "] rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) +
         ": ";
}

int index_of(const std::vector<int>& ranks, int rank) {
  return static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
}

uint64_t bytes_sent(const std::vector<P2POp>& ops) {
  uint64_t n = 0;
  for (const P2POp& op : ops)
    if (op.kind == P2POp::Kind::kSend) n += op.bytes;
  return n;
}

// ---- subgroup views --------------------------------------------------------------------------

class GroupView final : public Communicator {
 public:
  GroupView(std::shared_ptr<Communicator> parent, std::vector<int> ranks, int rank)
      : parent_(std::move(parent)), ranks_(std::move(ranks)), rank_(rank) {
    timeout_ = parent_->timeout();
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(ranks_.size()); }
  std::string transport() const override { return parent_->transport(); }

  std::unique_ptr<Communicator> split(int color, int key) override;

  std::unique_ptr<CommRequest> send_recv(const std::vector<P2POp>& ops) override {
    check_ops("send_recv", ops);
    std::vector<P2POp> translated = ops;
    for (P2POp& op : translated) op.peer = ranks_[static_cast<size_t>(op.peer)];
    parent_->set_timeout(timeout_);
    stats_.bytes_sent += bytes_sent(ops);
    return std::make_unique<Request>(parent_->send_recv(translated), stats_);
  }

  void fail(const std::string& reason) override { parent_->fail(reason); }

 private:
  // Counts the waiting time in the view's stats as well as the parent's.
  class Request final : public CommRequest {
   public:
    Request(std::unique_ptr<CommRequest> inner, Stats& stats) : inner_(std::move(inner)), stats_(stats) {}
    void wait() override {
      const Clock::time_point start = Clock::now();
      try {
        inner_->wait();
      } catch (...) {
        add_wait(start);
        throw;
      }
      add_wait(start);
    }

   private:
    void add_wait(Clock::time_point start) {
      stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    }
    std::unique_ptr<CommRequest> inner_;
    Stats& stats_;
  };

  std::shared_ptr<Communicator> parent_;
  std::vector<int> ranks_;  // parent rank of each rank of the view
  int rank_;
};

// ---- the torch bridge --------------------------------------------------------------------------

class BridgeComm final : public Communicator, public std::enable_shared_from_this<BridgeComm> {
 public:
  BridgeComm(nb::object bridge, int rank, int size, int device_type, int device_id)
      : bridge_(std::move(bridge)), rank_(rank), size_(size), device_type_(device_type), device_id_(device_id) {}

  ~BridgeComm() override {
    nb::gil_scoped_acquire gil;
    bridge_.reset();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string transport() const override { return "torch"; }

  std::unique_ptr<Communicator> split(int color, int key) override {
    std::vector<int> members = split_members(color, key);
    const int me = index_of(members, rank_);
    return std::make_unique<GroupView>(shared_from_this(), std::move(members), me);
  }

  std::unique_ptr<CommRequest> send_recv(const std::vector<P2POp>& ops) override {
    check_ops("send_recv", ops);
    if (!failed_.empty()) throw CommError(prefix("send_recv") + "this rank has failed: " + failed_);
    nb::gil_scoped_acquire gil;
    nb::list list;
    for (const P2POp& op : ops) {
      const size_t shape[1] = {op.bytes};
      nb::ndarray<nb::pytorch, uint8_t, nb::ndim<1>> buffer(op.data, 1, shape, nb::handle(), nullptr,
                                                            nb::dtype<uint8_t>(), device_type_, device_id_);
      list.append(nb::make_tuple(op.kind == P2POp::Kind::kSend, op.peer,
                                 nb::cast(buffer, nb::rv_policy::reference)));
    }
    nb::object handle;
    try {
      handle = bridge_.attr("send_recv")(list);
    } catch (nb::python_error& e) {
      throw CommError(prefix("send_recv") + e.what());
    }
    stats_.bytes_sent += bytes_sent(ops);
    return std::make_unique<Request>(*this, std::move(handle));
  }

  void fail(const std::string& reason) override {
    if (failed_.empty()) failed_ = reason.empty() ? "(no reason given)" : reason;
  }

 private:
  class Request final : public CommRequest {
   public:
    Request(BridgeComm& comm, nb::object handle) : comm_(comm), handle_(std::move(handle)) {}
    ~Request() override {
      nb::gil_scoped_acquire gil;
      handle_.reset();
    }
    void wait() override {
      const Clock::time_point start = Clock::now();
      std::string error;
      {
        nb::gil_scoped_acquire gil;
        try {
          comm_.bridge_.attr("wait")(handle_, std::chrono::duration<double>(comm_.timeout_).count());
        } catch (nb::python_error& e) {
          error = comm_.prefix("send_recv") + e.what();
        }
        handle_.reset();
      }
      comm_.end_wait(start, error);
    }

   private:
    BridgeComm& comm_;
    nb::object handle_;
  };

  nb::object bridge_;
  int rank_, size_, device_type_, device_id_;
  std::string failed_;
};

}  // namespace

std::shared_ptr<Communicator> subgroup(const std::shared_ptr<Communicator>& parent, const std::vector<int>& ranks) {
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  const bool distinct = std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
  const bool in_range = !sorted.empty() && sorted.front() >= 0 && sorted.back() < parent->size();
  if (!distinct || !in_range)
    throw InvalidArgument(where(*parent, "subgroup") + "ranks must be distinct ranks in [0, " +
                          std::to_string(parent->size()) + "), got " + std::to_string(ranks.size()) + " ranks");
  const auto me = std::find(ranks.begin(), ranks.end(), parent->rank());
  if (me == ranks.end())
    throw InvalidArgument(where(*parent, "subgroup") + "ranks must include this rank (" +
                          std::to_string(parent->rank()) + ")");
  return std::make_shared<GroupView>(parent, ranks, static_cast<int>(me - ranks.begin()));
}

std::unique_ptr<Communicator> GroupView::split(int color, int key) {
  std::vector<int> members = split_members(color, key);
  const int me = index_of(members, rank_);
  for (int& m : members) m = ranks_[static_cast<size_t>(m)];
  return std::make_unique<GroupView>(parent_, std::move(members), me);
}

std::shared_ptr<Communicator> split_shared(const std::shared_ptr<Communicator>& comm, int color, int key) {
  // The child may use its parent's state, so it keeps the parent alive.
  return std::shared_ptr<Communicator>(comm->split(color, key).release(),
                                       [parent = comm](Communicator* child) { delete child; });
}

void init_comm(nb::module_& m) {
  nb::class_<CommHandle>(m, "Communicator",
                         "A ringflash communicator (mpi, nccl, torch bridge, or a view of some of their ranks).")
      .def_prop_ro("rank", [](const CommHandle& c) { return c.comm->rank(); })
      .def_prop_ro("size", [](const CommHandle& c) { return c.comm->size(); })
      .def_prop_ro("transport", [](const CommHandle& c) { return c.comm->transport(); })
      .def_prop_rw(
          "timeout", [](const CommHandle& c) { return std::chrono::duration<double>(c.comm->timeout()).count(); },
          [](CommHandle& c, double seconds) {
            if (!(seconds > 0)) throw InvalidArgument("[timeout] must be > 0 seconds, got " + std::to_string(seconds));
            c.comm->set_timeout(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5)));
          },
          "Deadline of every wait, in seconds (default 300).")
      .def(
          "split",
          [](CommHandle& c, int color, int key) { return CommHandle{split_shared(c.comm, color, key)}; },
          "color"_a, "key"_a, nb::call_guard<nb::gil_scoped_release>(),
          "Collective: the ranks with the same color form a communicator, ordered by (key, rank).")
      .def(
          "subgroup", [](CommHandle& c, const std::vector<int>& ranks) { return CommHandle{subgroup(c.comm, ranks)}; },
          "ranks"_a, "A view of these ranks (this rank among them), in this order. Not collective.")
      .def(
          "barrier", [](CommHandle& c) { c.comm->barrier(); }, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "all_gather_bytes",
          [](CommHandle& c, nb::bytes data) {
            const size_t n = static_cast<size_t>(c.comm->size());
            std::vector<uint64_t> sizes(n);
            std::vector<char> all;
            std::vector<size_t> bytes(n);
            {
              nb::gil_scoped_release release;
              const uint64_t mine = data.size();
              c.comm->all_gather(&mine, sizes.data(), std::vector<size_t>(n, sizeof mine));
              size_t total = 0;
              for (size_t j = 0; j < n; ++j) total += bytes[j] = static_cast<size_t>(sizes[j]);
              all.resize(total);
              c.comm->all_gather(data.c_str(), all.data(), bytes);
            }
            nb::list result;
            size_t offset = 0;
            for (size_t j = 0; j < n; ++j) {
              result.append(nb::bytes(all.data() + offset, bytes[j]));
              offset += bytes[j];
            }
            return result;
          },
          "data"_a, "Collective: every rank's bytes (of any length), in rank order.")
      .def(
          "stats", [](const CommHandle& c) { return std::make_tuple(c.comm->stats().bytes_sent, c.comm->stats().wait_seconds); },
          "(bytes sent, seconds spent waiting) since the last reset_stats().")
      .def("reset_stats", [](CommHandle& c) { c.comm->reset_stats(); })
      .def_prop_ro("stream_ordered", [](const CommHandle& c) { return c.comm->stream_ordered(); },
                   "Whether operations are enqueued on a CUDA stream rather than finished before returning (nccl).")
      .def(
          "synchronize", [](CommHandle& c) { c.comm->synchronize(); }, nb::call_guard<nb::gil_scoped_release>(),
          "Blocks until every operation posted on this communicator (and the stream of its last call) is done; "
          "raises CommError if one failed or the deadline passed.")
      .def(
          "fail", [](CommHandle& c, const std::string& reason) { c.comm->fail(reason); }, "reason"_a,
          "Marks this rank failed: its peers' waits on it end with a CommError that gives the reason "
          "(where the transport can tell them; the torch bridge cannot, and its peers fail at their deadline).")
      .def("__repr__", [](const CommHandle& c) {
        return "<ringflash Communicator " + c.comm->transport() + " rank " + std::to_string(c.comm->rank()) + " of " +
               std::to_string(c.comm->size()) + ">";
      });

  m.def(
      "mpi_world",
      [] { return CommHandle{std::shared_ptr<Communicator>(mpi_world())}; },
      nb::call_guard<nb::gil_scoped_release>(),
      "Every process of the mpiexec job, in MPI_COMM_WORLD's order. Raises NotSupported without MPI.");
  m.def(
      "nccl_unique_id",
      [] {
        const NcclUniqueId id = nccl_unique_id();
        return nb::bytes(reinterpret_cast<const char*>(id.bytes), sizeof(id.bytes));
      },
      "A new NCCL unique id (bytes) for nccl_communicator. Raises NotSupported without NCCL.");
  m.def(
      "nccl_communicator",
      [](nb::bytes id, int rank, int size, int device, double timeout) {
        if (id.size() != sizeof(NcclUniqueId::bytes))
          throw InvalidArgument("[nccl_communicator] id must have " + std::to_string(sizeof(NcclUniqueId::bytes)) +
                                " bytes (from nccl_unique_id), got " + std::to_string(id.size()));
        if (!(timeout > 0))
          throw InvalidArgument("[nccl_communicator] timeout must be > 0 seconds, got " + std::to_string(timeout));
        NcclUniqueId nid;
        std::memcpy(nid.bytes, id.c_str(), sizeof(nid.bytes));
        const auto t = std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000.0 + 0.5));
        nb::gil_scoped_release release;
        return CommHandle{std::shared_ptr<Communicator>(nccl_communicator(nid, rank, size, device, t))};
      },
      "id"_a, "rank"_a, "size"_a, "device"_a, "timeout"_a = 300.0,
      "Collective: the nccl communicator of `size` ranks that passed the same id, this one on CUDA device "
      "`device`.");
  m.def(
      "nccl_world",
      [](CommHandle& bootstrap, int device) {
        return CommHandle{std::shared_ptr<Communicator>(nccl_communicator(*bootstrap.comm, device))};
      },
      "bootstrap"_a, "device"_a, nb::call_guard<nb::gil_scoped_release>(),
      "Collective over `bootstrap` (e.g. mpi_world()): an nccl communicator of the same ranks, this one on CUDA "
      "device `device`, with rank 0's unique id sent over `bootstrap`.");
  m.def(
      "bridge",
      [](nb::object obj, int rank, int size, int device_type, int device_id) {
        if (size < 1 || rank < 0 || rank >= size)
          throw InvalidArgument("[bridge] rank must be in [0, size) and size >= 1, got rank " + std::to_string(rank) +
                                " of " + std::to_string(size));
        return CommHandle{std::make_shared<BridgeComm>(std::move(obj), rank, size, device_type, device_id)};
      },
      "bridge"_a, "rank"_a, "size"_a, "device_type"_a = 1, "device_id"_a = 0,
      "A communicator over a Python object with send_recv(ops) and wait(handle, seconds); device_type "
      "is DLPack's (1 cpu, 2 cuda).");
}

}  // namespace ringflash::python
