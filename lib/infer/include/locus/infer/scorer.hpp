// Scoring a block of rows with a model: the forward pass over a fixed batch grid, softmax
// probabilities (or raw outputs), argmax, top-k and label metrics. Pure computation, no MPI,
// no HDF5: locus-infer runs the forward passes on its compute thread and the rest on its main
// thread.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "locus/train/model/forward.hpp"
#include "locus/train/model/model.hpp"

namespace locus::infer {

// probabilities: softmax of the logits, argmax class and optional top-k (classifiers).
// raw: the model's outputs as they are (regression); no argmax, top-k or metrics.
enum class OutputKind { probabilities, raw };
OutputKind parse_output_kind(std::string_view name);  // ConfigError
std::string_view to_string(OutputKind k) noexcept;

struct ScoreSpec {
  OutputKind kind = OutputKind::probabilities;
  int top_k = 0;         // 0: none; at most the output width
  int batch_rows = 256;  // rows per forward pass
};

// Sums over labelled rows, mergeable across units and ranks.
struct Metrics {
  std::int64_t rows = 0;           // labelled rows counted
  std::int64_t correct = 0;
  std::int64_t out_of_range = 0;   // labels outside [0, classes): excluded from everything
  double log_loss_sum = 0.0;       // sum of -log softmax(z)[label], from the logits in double
  std::vector<std::int64_t> confusion;  // [classes, classes]: confusion[true * C + predicted]

  void reset(int classes);
  void merge(const Metrics& o);
};

// The results for one block of rows, row-major.
struct Scores {
  std::vector<float> values;            // [n, outputs]: probabilities or raw outputs
  std::vector<std::int32_t> predicted;  // [n] (probabilities only)
  std::vector<std::int32_t> topk_index; // [n, k]
  std::vector<float> topk_value;        // [n, k]
  Metrics metrics;                      // when labels were given
};

// ConfigError for a top_k above the output width, top_k or probabilities with a single-output
// model, or batch_rows < 1; else spec. What the Scorer checks, without its buffers.
const ScoreSpec& check_score_spec(const ScoreSpec& spec, int outputs);

class Scorer {
 public:
  // The model must outlive the scorer. ConfigError as check_score_spec.
  Scorer(const train::Mlp& model, const ScoreSpec& spec);

  int outputs() const noexcept { return outputs_; }
  const ScoreSpec& spec() const noexcept { return spec_; }

  // Scores rows [first_row, first_row + n) of a dataset, x = their features [n, inputs].
  // The forward pass runs over the batch grid grid_origin + j * batch_rows: every batch is
  // computed as a full batch_rows-row matrix (rows outside the block are zero padding), so each
  // row is computed in the same position of the same-shaped product whatever block, unit, rank
  // or run it is scored in -- the results are bit-identical across world sizes, speculative
  // re-runs and incremental runs. labels (may be empty) adds metrics. stop() is polled after
  // every batch; when it returns true the block is abandoned and score() returns false.
  bool score(std::uint64_t grid_origin, std::uint64_t first_row, std::span<const float> x,
             std::span<const std::int32_t> labels, Scores& out,
             const std::function<bool()>& stop = {});

  // score() in two halves, so that a pipeline can run them on different threads and a block
  // can be computed in pieces: forward() writes the logits of the n rows of x into `logits`
  // ([n, outputs]; the batch grid and the stop poll as in score(); false when stopped);
  // finish() turns the logits of a block into `out` (softmax or raw values, argmax, top-k,
  // metrics). finish() is const and touches no scorer buffer, so it may run concurrently with
  // forward(). Same bytes as score(), however a block is cut into pieces along its batch grid.
  bool forward(std::uint64_t grid_origin, std::uint64_t first_row, std::span<const float> x,
               std::span<float> logits, const std::function<bool()>& stop = {});
  void finish(std::span<const float> logits, std::span<const std::int32_t> labels,
              Scores& out) const;

 private:
  void finish_rows(std::span<const float> logits, int row0, int rows,
                    std::span<const std::int32_t> labels, Scores& out) const;

  const train::Mlp& model_;
  ScoreSpec spec_;
  int inputs_ = 0;
  int outputs_ = 0;
  train::Workspace ws_;
  std::vector<float> padded_;  // [batch_rows, inputs] for batches that are not full
  std::vector<float> logits_;  // score()'s forward() output
};

}  // namespace locus::infer
