// the portable variant of the fused kernel (its -m flags: setup.py ISA_FLAGS)
#define ATTNPLUG_ISA portable
#include "attention.cpp"
