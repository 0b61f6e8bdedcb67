// The chunked all-reduce engine. Two protocols, chosen per chunk from its length alone (so all
// ranks choose alike):
//  - exchange (small chunks): one round; every rank receives every peer's whole chunk and sums
//    all of them locally, in rank order.
//  - scatter/gather (large chunks): the owner of each 1/size segment receives that segment from
//    every peer and sums it in rank order (reduce-scatter), then sends the result to every peer
//    (allgather). Each rank moves 2(size-1)/size of the chunk, as a ring would, but in two
//    rounds instead of 2(size-1), and the sum order does not depend on the owner. It posts
//    size-1 messages per round: meant for node-sized data-parallel groups, not thousands.
// Either way element i is ((x_0 + x_1) + x_2) + ... in float on every rank, so the protocols,
// the chunk size and the rank that owns a segment never change a single bit of the result.
#include "chunk_allreduce.hpp"

#include <algorithm>
#include <cmath>

#include "locus/comm/error.hpp"

namespace locus::comm::detail {

namespace {

constexpr std::size_t block = 1024;   // floats per reduction block (4 KiB: stays in L1)
constexpr int phases = 4;             // tag = (seq % tag_window) * phases + phase code
constexpr std::size_t tag_window = 32767 / phases;   // MPI guarantees tags up to 32767

// Fixed trip counts let -O2 vectorize these loops without a scalar epilogue.
void add_block(float* acc, const float* a, const float* b) {
  for (std::size_t i = 0; i < block; ++i) acc[i] = a[i] + b[i];
}
void accumulate_block(float* acc, const float* a) {
  for (std::size_t i = 0; i < block; ++i) acc[i] += a[i];
}
void divide_block(float* acc, float divisor) {
  for (std::size_t i = 0; i < block; ++i) acc[i] /= divisor;
}
void scale_block(float* acc, float factor) {
  for (std::size_t i = 0; i < block; ++i) acc[i] *= factor;
}

// Dividing by a power of two and multiplying by its reciprocal give the same bits (both are
// exact up to one final rounding), and the multiply is several times cheaper.
bool is_power_of_two(float x) {
  int exponent = 0;
  return x > 0 && std::frexp(x, &exponent) == 0.5f;
}

// Element by element, in the same order as the blocks: the last partial block.
void reduce_tail(float* out, const float* const* src, int nsrc, std::size_t first,
                 std::size_t last, float divisor) {
  for (std::size_t i = first; i < last; ++i) {
    float acc = src[0][i];
    for (int j = 1; j < nsrc; ++j) acc += src[j][i];
    out[i] = divisor == 1.0f ? acc : acc / divisor;
  }
}

}  // namespace

void reduce_in_rank_order(float* out, const float* const* src, int nsrc, std::size_t len,
                          float divisor) {
  LOCUS_ASSERT(nsrc >= 1, "reduce_in_rank_order needs at least one source");
  if (nsrc == 1 && divisor == 1.0f && out == src[0]) return;
  const bool reciprocal = divisor != 1.0f && is_power_of_two(divisor);
  alignas(64) float acc[block];
  std::size_t b = 0;
  for (; b + block <= len; b += block) {
    if (nsrc == 1) {
      std::copy_n(src[0] + b, block, acc);
    } else {
      add_block(acc, src[0] + b, src[1] + b);
    }
    for (int j = 2; j < nsrc; ++j) accumulate_block(acc, src[j] + b);
    if (reciprocal) {
      scale_block(acc, 1.0f / divisor);
    } else if (divisor != 1.0f) {
      divide_block(acc, divisor);
    }
    // Written only after every source block was read: out may alias one of them.
    std::copy_n(acc, block, out + b);
  }
  reduce_tail(out, src, nsrc, b, len, divisor);
}

ChunkEngine::ChunkEngine(MPI_Comm comm, const ChunkEngineConfig& config)
    : comm_(comm), config_(config) {
  LOCUS_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  LOCUS_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  LOCUS_ASSERT(config_.max_in_flight >= 1 && config_.chunk_elems >= 1 &&
                   config_.fragment_elems >= 1,
               "ChunkEngine needs positive chunk and fragment sizes and in-flight depth");
  const auto peers = static_cast<std::size_t>(size_ - 1);
  const std::size_t per_owner = (config_.chunk_elems + size_ - 1) / size_;
  // A peer's contribution is a whole chunk in the exchange protocol (small or tiny chunks),
  // one owner's segment in scatter/gather.
  const std::size_t exchanged =
      std::min(config_.chunk_elems,
               std::max(config_.small_elems, static_cast<std::size_t>(size_)));
  scratch_stride_ = std::max(exchanged, per_owner);
  // Only messages of at most small_elems are fragmented; a tiny chunk (fewer elements than
  // ranks) is exchanged whole, in at most ceil(size / fragment) fragments.
  const std::size_t fragmented =
      std::max(std::min(config_.small_elems, config_.chunk_elems),
               static_cast<std::size_t>(size_));
  const std::size_t max_fragments =
      (fragmented + config_.fragment_elems - 1) / config_.fragment_elems;
  // Allocated and touched once here: first-touch page faults are expensive on VMs.
  scratch_.assign(static_cast<std::size_t>(config_.max_in_flight) * peers * scratch_stride_,
                  0.0f);
  slots_.resize(static_cast<std::size_t>(config_.max_in_flight));
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    slots_[i].scratch = scratch_.data() + i * peers * scratch_stride_;
    slots_[i].requests.assign(2 * peers * std::max<std::size_t>(1, max_fragments),
                              MPI_REQUEST_NULL);
  }
  sources_.resize(static_cast<std::size_t>(size_));
}

ChunkEngine::~ChunkEngine() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0) return;
  for (Slot& s : slots_) {
    for (int i = 0; i < s.posted; ++i) {
      auto& r = s.requests[static_cast<std::size_t>(i)];
      if (r == MPI_REQUEST_NULL) continue;
      if (i < s.receives) MPI_Cancel(&r);   // receives into memory about to be freed
      MPI_Request_free(&r);
    }
  }
}

void ChunkEngine::segment(std::size_t count, int owner, std::size_t& off,
                          std::size_t& len) const {
  const auto n = static_cast<std::size_t>(size_);
  const auto r = static_cast<std::size_t>(owner);
  const std::size_t base = count / n;
  const std::size_t rem = count % n;
  off = r * base + std::min(r, rem);
  len = base + (r < rem ? 1 : 0);
}

void ChunkEngine::launch(float* data, std::size_t count, std::size_t seq) {
  LOCUS_ASSERT(has_free_slot(), "ChunkEngine::launch without a free slot");
  LOCUS_ASSERT(count >= 1 && count <= config_.chunk_elems, "chunk longer than chunk_elems");
  auto it = std::find_if(slots_.begin(), slots_.end(),
                         [](const Slot& s) { return s.phase == Phase::idle; });
  Slot& s = *it;
  s.data = data;
  s.count = count;
  s.tag = static_cast<int>(seq % tag_window) * phases;
  ++active_;
  // Tiny chunks (fewer elements than ranks) would leave some owners empty: exchange them.
  if (count <= config_.small_elems || count < static_cast<std::size_t>(size_)) {
    post_exchange(s);
  } else {
    post_scatter(s);
  }
}

// Messages of at most small_elems go as eager-sized fragments: on shared memory one round of
// eager copies beats a rendezvous handshake at these sizes. Larger ones go whole (single
// copy). Sender and receiver decide from the length alone, so their fragments match.
void ChunkEngine::post(Slot& s, bool receive, float* buf, std::size_t len, int peer, int tag) {
  const std::size_t piece = len <= config_.small_elems ? config_.fragment_elems : len;
  std::size_t f = 0;
  do {
    const auto n = static_cast<int>(std::min(piece, len - f));
    LOCUS_ASSERT(static_cast<std::size_t>(s.posted) < s.requests.size(),
                 "ChunkEngine posted more messages than it preallocated requests for");
    MPI_Request* r = &s.requests[static_cast<std::size_t>(s.posted++)];
    if (receive) {
      LOCUS_MPI_CHECK(MPI_Irecv(buf + f, n, MPI_FLOAT, peer, tag, comm_, r));
    } else {
      LOCUS_MPI_CHECK(MPI_Isend(buf + f, n, MPI_FLOAT, peer, tag, comm_, r));
    }
    f += static_cast<std::size_t>(n);
  } while (f < len);
}

float* ChunkEngine::contribution(Slot& s, int peer) const {
  const int index = peer < rank_ ? peer : peer - 1;
  return s.scratch + static_cast<std::size_t>(index) * scratch_stride_;
}

// Receives are posted before sends so a peer's data rarely waits in the unexpected queue.
void ChunkEngine::post_exchange(Slot& s) {
  s.phase = Phase::exchange;
  s.posted = 0;
  for (int j = 0; j < size_; ++j)
    if (j != rank_) post(s, true, contribution(s, j), s.count, j, s.tag);
  s.receives = s.posted;
  for (int j = 0; j < size_; ++j)
    if (j != rank_) post(s, false, s.data, s.count, j, s.tag);
}

void ChunkEngine::post_scatter(Slot& s) {
  s.phase = Phase::scatter;
  s.posted = 0;
  std::size_t off = 0;
  std::size_t len = 0;
  segment(s.count, rank_, off, len);
  for (int j = 0; j < size_; ++j)
    if (j != rank_) post(s, true, contribution(s, j), len, j, s.tag + 1);
  s.receives = s.posted;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    segment(s.count, j, off, len);
    post(s, false, s.data + off, len, j, s.tag + 1);
  }
}

void ChunkEngine::post_gather(Slot& s) {
  s.phase = Phase::gather;
  s.posted = 0;
  std::size_t off = 0;
  std::size_t len = 0;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    segment(s.count, j, off, len);
    post(s, true, s.data + off, len, j, s.tag + 2);
  }
  s.receives = s.posted;
  segment(s.count, rank_, off, len);
  for (int j = 0; j < size_; ++j)
    if (j != rank_) post(s, false, s.data + off, len, j, s.tag + 2);
}

void ChunkEngine::reduce_received(Slot& s, float* own, std::size_t len) {
  for (int j = 0; j < size_; ++j)
    sources_[static_cast<std::size_t>(j)] = j == rank_ ? own : contribution(s, j);
  const float divisor = config_.divide ? static_cast<float>(size_) : 1.0f;
  reduce_in_rank_order(own, sources_.data(), size_, len, divisor);
}

bool ChunkEngine::advance(Slot& s) {
  int done = 0;
  LOCUS_MPI_CHECK(MPI_Testall(s.posted, s.requests.data(), &done, MPI_STATUSES_IGNORE));
  if (done == 0) return false;
  switch (s.phase) {
    case Phase::exchange:
      reduce_received(s, s.data, s.count);
      return true;
    case Phase::scatter: {
      std::size_t off = 0;
      std::size_t len = 0;
      segment(s.count, rank_, off, len);
      reduce_received(s, s.data + off, len);
      post_gather(s);
      return false;
    }
    case Phase::gather: return true;
    case Phase::idle: break;
  }
  LOCUS_ASSERT(false, "ChunkEngine::advance on an idle slot");
  return false;
}

int ChunkEngine::progress() {
  int completed = 0;
  for (Slot& s : slots_) {
    if (s.phase == Phase::idle || !advance(s)) continue;
    s.phase = Phase::idle;
    --active_;
    ++completed;
  }
  return completed;
}

}  // namespace locus::comm::detail
