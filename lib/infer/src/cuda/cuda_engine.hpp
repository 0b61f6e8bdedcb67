// Private to lib/infer: the CUDA engine's entry points for the factory in engine.cpp (built
// only with LOCUS_WITH_CUDA).
#pragma once

#include <memory>
#include <string>

#include "engine.hpp"

namespace locus::infer::detail {

// Collective over comm: selects this rank's GPU (infer.device; -1: the node-local rank modulo
// the visible devices) and makes it current. Returns its index; *description: "cuda fp32 on
// device 0 NVIDIA H100 80GB HBM3 (79.1 GiB, cc 9.0, 132 SMs)". ConfigError (not agreed) naming
// infer.backend when the host has no usable GPU, infer.device when the index is out of range.
int cuda_select_device(const mpi::Comm& comm, int requested, train::Precision precision,
                       std::string* description);

// The engine on device `device` (current on the calling thread): the model uploaded once.
std::unique_ptr<Engine> make_cuda_engine(const train::Mlp& model, const ScoreSpec& spec,
                                         train::Precision precision, int device);

}  // namespace locus::infer::detail
