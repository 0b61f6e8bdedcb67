#!/bin/sh
# Test device only: runs one MPI rank as if it were on a host of its own for NCCL (its own
# NCCL_HOSTID, sockets over loopback, no P2P or shared memory), so that two ranks on one GPU can
# form one NCCL communicator (NCCL refuses them otherwise: "Duplicate GPU detected"). Never for
# performance figures. Used by run_gpu.sh:  mpirun -n 2 bench/gpu/hostid_rank.sh PROGRAM ARGS...
# LOCUS_REQUIRE_NCCL=1: the NCCL tests fail instead of skipping where NCCL refuses the ranks.
export NCCL_HOSTID="locus-rank-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}" NCCL_P2P_DISABLE=1 \
  NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo LOCUS_REQUIRE_NCCL=1
exec "$@"
