/* Memory latency probe (docs/BENCHMARKS.md, "Would 1 GiB pages close it?").
 * One thread follows a random cycle through every 64-byte line of a buffer,
 * so each read depends on the one before: ns per read = latency.
 *   gcc -O2 -o chase scripts/chase.c
 *   ./chase MODE MiB     MODE 0: 4 KiB pages, 1: 2 MiB (THP), 2: 1 GiB (hugetlbfs;
 *                        echo N > /sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages)
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#ifndef MAP_HUGE_1GB
#define MAP_HUGE_1GB (30 << 26)
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: chase MODE MiB\n");
        return 2;
    }
    int mode = atoi(argv[1]);
    size_t size = (size_t)atol(argv[2]) << 20, huge = 2 << 20;
    void *p;
    if (mode == 2) {
        p = mmap(0, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | MAP_HUGE_1GB, -1, 0);
    } else {
        p = mmap(0, size + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p != MAP_FAILED) {
            p = (void *)(((uintptr_t)p + huge - 1) & ~(uintptr_t)(huge - 1));
            madvise(p, size, mode == 1 ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        }
    }
    if (p == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    size_t lines = size / 64;
    uint64_t *a = p;
    uint32_t *perm = malloc(lines * sizeof *perm);
    if (!perm)
        return 1;
    for (size_t i = 0; i < lines; i++)
        perm[i] = i;
    uint64_t x = 88172645463325252ULL; /* xorshift64: a fixed shuffle */
    for (size_t i = lines - 1; i > 0; i--) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        size_t j = x % (i + 1);
        uint32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (size_t i = 0; i < lines; i++)
        a[(size_t)perm[i] * 8] = (uint64_t)perm[(i + 1) % lines] * 8;
    free(perm);
    size_t k = 0, reads = 20000000;
    double t0 = now();
    for (size_t i = 0; i < reads; i++)
        k = a[k];
    double t1 = now();
    printf("mode %d, %zu MiB: %.1f ns per read (end %zu)\n", mode, size >> 20,
           (t1 - t0) * 1e9 / reads, k);
    return 0;
}
