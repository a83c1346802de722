// hybrid (USP): ulysses inside, ring outside, on a 2D layout of R x U ranks.
//
// The ring layout (options.hybrid_ring_layout) gives each ring position r a shard of the sequence,
// and the U ranks of its ulysses group hold that shard's rows cut contiguously in order
// (hybrid_shard). The Ulysses all-to-all over the ulysses group turns the U pieces of one ring
// shard into all of that ring shard's rows for this rank's heads (the first H % U ranks one more;
// KV heads as in ulysses). Those rows are exactly what the ring layout gives ring rank r, so the
// ring strategy runs over the ring group on them, and a second all-to-all brings out and lse back.
// The ring is given fp32 gradient tensors and writes them in fp32, so a replicated KV head's
// gradients are summed over the ulysses group before they are rounded to the input dtype.
//
// The joined rows the ring works on sit in the exchange's workspace, and the ring keeps its own
// buffers in a workspace of its own, both on the tensors' device; the host never touches the data.
#include <vector>

#include "reshard.h"
#include "strategy.h"

namespace ringflash::parallel {
namespace {

// Ulysses rank u of ring rank r holds hybrid_shard(layout, L, r, R, u, U) of every sequence; joined
// over the ulysses group they are ring rank r's shard.
RowPlan hybrid_plan(const Problem& p, Communicator& ulysses, Communicator& ring, Layout layout) {
  return make_row_plan(p, ulysses.size(), [&](int rank, int64_t length) {
    return shard_rows(hybrid_shard(layout, length, ring.rank(), ring.size(), rank, ulysses.size()));
  });
}

}  // namespace

void hybrid_forward(Communicator& ulysses, Communicator& ring, const Problem& p, const ParallelOptions& options) {
  const Layout layout = options.hybrid_ring_layout;
  ulysses_exchange_forward(ulysses, p, hybrid_plan(p, ulysses, ring, layout),
                           [&](const Problem& joined) { ring_forward(ring, layout, joined); });
}

void hybrid_backward(Communicator& ulysses, Communicator& ring, const Problem& p, const ParallelOptions& options) {
  const Layout layout = options.hybrid_ring_layout;
  ulysses_exchange_backward(ulysses, p, hybrid_plan(p, ulysses, ring, layout),
                            [&](const Problem& joined) { ring_backward(ring, layout, joined); });
}

}  // namespace ringflash::parallel
