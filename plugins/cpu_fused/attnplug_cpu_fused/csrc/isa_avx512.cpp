// the avx512 variant of the fused kernel (its -m flags: setup.py ISA_FLAGS)
#define ATTNPLUG_ISA avx512
#include "attention.cpp"
