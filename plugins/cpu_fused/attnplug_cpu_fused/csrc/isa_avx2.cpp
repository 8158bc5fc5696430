// the avx2 variant of the fused kernel (its -m flags: setup.py ISA_FLAGS)
#define ATTNPLUG_ISA avx2
#include "attention.cpp"
