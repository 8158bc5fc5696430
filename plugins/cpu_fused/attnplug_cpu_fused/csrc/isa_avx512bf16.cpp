// the avx512bf16 variant of the fused kernel (its -m flags: setup.py ISA_FLAGS)
#define ATTNPLUG_ISA avx512bf16
#include "attention.cpp"
