// One host, DRAM: what a copy of N scattered 4 KiB blocks costs each way a
// transfer could make it (docs/benchmarks.md, "Why the DRAM arena stops
// near 2.5x on 2 cores"): cross-memory attach (process_vm_writev) with
// 1024 blocks a call, CMA with one call a block (what UCX's cma transport
// does per descriptor), a direct memcpy (the floor), and a gather memcpy
// into a contiguous buffer (one of the arena's three copies). In one
// process, as the API sweep's two agents are; CMA to another process pins
// the same pages the same way.
//
//   gcc -O2 -o /tmp/cma_probe bench/cma_probe.c && /tmp/cma_probe 4096 12
#define _GNU_SOURCE
#include <sys/uio.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int n=atoi(argv[1]), bs=4096, blocks=2*n, iters=atoi(argv[2]);
  char*src=aligned_alloc(4096,(size_t)blocks*bs), *dst=aligned_alloc(4096,(size_t)blocks*bs), *stage=aligned_alloc(4096,(size_t)n*bs);
  memset(src,1,(size_t)blocks*bs); memset(dst,2,(size_t)blocks*bs); memset(stage,3,(size_t)n*bs);
  struct iovec *l=malloc(sizeof(*l)*n), *r=malloc(sizeof(*r)*n);
  int *perm=malloc(sizeof(int)*blocks);
  double tb=0,tm=0,t1=0,tg=0; pid_t me=getpid();
  for(int it=0;it<iters;it++){
    for(int i=0;i<blocks;i++)perm[i]=i;
    for(int i=blocks-1;i>0;i--){int j=rand()%(i+1);int x=perm[i];perm[i]=perm[j];perm[j]=x;}
    for(int i=0;i<n;i++){l[i].iov_base=src+(size_t)perm[i]*bs;l[i].iov_len=bs;r[i].iov_base=dst+(size_t)perm[blocks-1-i]*bs;r[i].iov_len=bs;}
    double a=now();
    for(int i=0;i<n;i+=1024){int k=n-i<1024?n-i:1024; if(process_vm_writev(me,l+i,k,r+i,k,0)<0){perror("pvw");return 1;}}
    double b=now();
    for(int i=0;i<n;i++) if(process_vm_writev(me,l+i,1,r+i,1,0)<0){perror("pvw1");return 1;}
    double c=now();
    for(int i=0;i<n;i++) memcpy(r[i].iov_base,l[i].iov_base,bs);
    double d=now();
    for(int i=0;i<n;i++) memcpy(stage+(size_t)i*bs,l[i].iov_base,bs);
    double e=now();
    if(it>0){tb+=b-a;t1+=c-b;tm+=d-c;tg+=e-d;}
  }
  int k=iters-1;
  printf("%d x 4KiB: batched CMA (1024 iov/call) %.3f ms, one CMA call per block %.3f ms, memcpy direct %.3f ms, gather memcpy %.3f ms\n",n,tb/k*1e3,t1/k*1e3,tm/k*1e3,tg/k*1e3);
}
