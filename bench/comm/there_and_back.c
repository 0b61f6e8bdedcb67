/* The hierarchical reduction's traffic between two leaders, in plain MPI: rank 0 sends K
 * chunks to rank 1 at once; rank 1 sends each back as soon as it has arrived; every receive is
 * posted before the first send. Where the two directions of the link overlap this takes about
 * K chunks' time on the wire; where the way back waits for the way out (as with Open MPI's
 * rendezvous over one TCP connection, bench/RESULTS.md "Over a network") about twice that.
 * Each chunk can go as one message or as fragments of FRAGMENT bytes.
 *   mpirun -n 2 locus_there_and_back [CHUNKS [CHUNK_BYTES [FRAGMENT_BYTES [LINK_MB_S]]]]
 * (defaults 16, 1 MiB, whole chunks, 118: a TCP stream over a 1 Gbit/s link). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int chunks = argc > 1 ? atoi(argv[1]) : 16;
  const int chunk = argc > 2 ? atoi(argv[2]) : 1 << 20;
  const int fragment = argc > 3 ? atoi(argv[3]) : chunk;
  const double link_mb_s = argc > 4 ? atof(argv[4]) : 118.0;
  if (size != 2 || chunks < 1 || chunk < 1 || fragment < 1 || chunk % fragment != 0) {
    if (rank == 0) {
      fprintf(stderr, "usage: mpirun -n 2 %s [CHUNKS [CHUNK_BYTES [FRAGMENT_BYTES [LINK_MB_S]]]] "
              "(2 ranks; FRAGMENT_BYTES must divide CHUNK_BYTES)\n", argv[0]);
    }
    MPI_Finalize();
    return 2;
  }
  const int per = chunk / fragment;
  const int messages = chunks * per;
  char* buf = malloc((size_t)chunks * (size_t)chunk);
  MPI_Request* req = malloc(sizeof(MPI_Request) * 2 * (size_t)messages);
  if (buf == NULL || req == NULL) MPI_Abort(MPI_COMM_WORLD, 1);
  memset(buf, 1, (size_t)chunks * (size_t)chunk);
  const int peer = 1 - rank;
  for (int rep = 0; rep < 5; ++rep) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (int m = 0; m < messages; ++m) {   /* every receive first: out on rank 1, back on rank 0 */
      MPI_Irecv(buf + (size_t)m * fragment, fragment, MPI_CHAR, peer, m / per, MPI_COMM_WORLD,
                &req[m]);
    }
    if (rank == 0) {
      for (int m = 0; m < messages; ++m) {
        MPI_Isend(buf + (size_t)m * fragment, fragment, MPI_CHAR, peer, m / per, MPI_COMM_WORLD,
                  &req[messages + m]);
      }
    } else {
      for (int k = 0; k < chunks; ++k) {   /* each chunk back as soon as it is in */
        MPI_Waitall(per, &req[k * per], MPI_STATUSES_IGNORE);
        for (int f = 0; f < per; ++f) {
          const int m = k * per + f;
          MPI_Isend(buf + (size_t)m * fragment, fragment, MPI_CHAR, peer, k, MPI_COMM_WORLD,
                    &req[messages + m]);
        }
      }
    }
    MPI_Waitall(2 * messages, req, MPI_STATUSES_IGNORE);
    const double t = MPI_Wtime() - t0;
    if (rank == 0) {
      const double one_way = (double)chunks * chunk / (link_mb_s * 1e6);
      printf("%d x %d B there and back in %d-B messages: %.1f ms (both directions at once: "
             "%.1f ms; one after the other: %.1f ms, at %.0f MB/s)\n",
             chunks, chunk, fragment, t * 1e3, one_way * 1e3, 2 * one_way * 1e3, link_mb_s);
    }
  }
  free(req);
  free(buf);
  MPI_Finalize();
  return 0;
}
