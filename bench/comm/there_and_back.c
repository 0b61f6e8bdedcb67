/* The hierarchical reduction's traffic between two leaders, in plain MPI: rank 0 sends K
 * chunks to rank 1 at once; rank 1 sends each back as soon as it has arrived; every receive is
 * posted before the first send. Where the two directions of the link overlap this takes about
 * K chunks' time on the wire; where the way back waits for the way out (as with Open MPI's
 * rendezvous over one TCP connection, bench/RESULTS.md "Over a network") about twice that.
 * Each chunk can go as one message or as fragments of FRAGMENT bytes.
 *   mpirun -n 2 locus_there_and_back [CHUNKS [CHUNK_BYTES [FRAGMENT_BYTES [LINK_MB_S]]]]
 * (defaults 16, 1 MiB, whole chunks, 118: a TCP stream over a 1 Gbit/s link). */
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const long chunks = argc > 1 ? strtol(argv[1], NULL, 10) : 16;
  const long chunk = argc > 2 ? strtol(argv[2], NULL, 10) : 1 << 20;
  const long fragment = argc > 3 ? strtol(argv[3], NULL, 10) : chunk;
  const double link_mb_s = argc > 4 ? atof(argv[4]) : 118.0;
  /* Message counts and sizes are ints in MPI; the requests of both directions too. */
  if (size != 2 || chunks < 1 || chunk < 1 || fragment < 1 || chunk > INT_MAX ||
      chunk % fragment != 0 || chunks * (chunk / fragment) > INT_MAX / 2 || !(link_mb_s > 0)) {
    if (rank == 0) {
      fprintf(stderr, "usage: mpirun -n 2 %s [CHUNKS [CHUNK_BYTES [FRAGMENT_BYTES [LINK_MB_S]]]] "
              "(2 ranks; positive values; FRAGMENT_BYTES divides CHUNK_BYTES; fewer than 2^30 "
              "messages)\n", argv[0]);
    }
    MPI_Finalize();
    return 2;
  }
  const int per = (int)(chunk / fragment);
  const int messages = (int)(chunks * per);
  const size_t bytes = (size_t)chunks * (size_t)chunk;
  /* Rank 0 sends from out and receives into back (a buffer must not be received into while a
   * send from it is pending); rank 1 receives into out and sends each chunk back from there. */
  char* out = malloc(bytes);
  char* back = malloc(bytes);
  MPI_Request* req = malloc(sizeof(MPI_Request) * 2 * (size_t)messages);
  if (out == NULL || back == NULL || req == NULL) MPI_Abort(MPI_COMM_WORLD, 1);
  memset(out, 1, bytes);
  char* const in = rank == 0 ? back : out;
  const int peer = 1 - rank;
  for (int rep = 0; rep < 5; ++rep) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (int m = 0; m < messages; ++m) {   /* every receive first: out on rank 1, back on rank 0 */
      MPI_Irecv(in + (size_t)m * fragment, (int)fragment, MPI_CHAR, peer, m / per, MPI_COMM_WORLD,
                &req[m]);
    }
    if (rank == 0) {
      for (int m = 0; m < messages; ++m) {
        MPI_Isend(out + (size_t)m * fragment, (int)fragment, MPI_CHAR, peer, m / per,
                  MPI_COMM_WORLD, &req[messages + m]);
      }
    } else {
      for (int k = 0; k < chunks; ++k) {   /* each chunk back as soon as it is in */
        MPI_Waitall(per, &req[k * per], MPI_STATUSES_IGNORE);
        for (int f = 0; f < per; ++f) {
          const int m = k * per + f;
          MPI_Isend(out + (size_t)m * fragment, (int)fragment, MPI_CHAR, peer, k, MPI_COMM_WORLD,
                    &req[messages + m]);
        }
      }
    }
    MPI_Waitall(2 * messages, req, MPI_STATUSES_IGNORE);
    const double t = MPI_Wtime() - t0;
    if (rank == 0) {
      const double one_way = (double)chunks * chunk / (link_mb_s * 1e6);
      printf("%ld x %ld B there and back in %ld-B messages: %.1f ms (both directions at once: "
             "%.1f ms; one after the other: %.1f ms, at %.0f MB/s)\n",
             chunks, chunk, fragment, t * 1e3, one_way * 1e3, 2 * one_way * 1e3, link_mb_s);
    }
  }
  free(req);
  free(back);
  free(out);
  MPI_Finalize();
  return 0;
}
