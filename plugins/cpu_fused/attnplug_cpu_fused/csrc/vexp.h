// The vectorised exp both kernels use, as text: attention.cpp (compiled once per ISA by isa_*.cpp) and
// extend_tiled.cpp (one body per ISA by target attributes) each include it inside their own per-ISA
// namespace, after defining vf/vi/vu, splat() and bits(), with ATTNPLUG_VEXP_ATTR set to their function
// attribute (empty, or the ISA's target). No include guard: it is meant to be included once per ISA.
//
// exp(x) for x <= 0 (and NaN): Cephes' polynomial on the reduced argument, 2^n by exponent bits; below
// -87 (e^-87 < 2^-125: nothing next to the row maximum's 1) it is 0, -inf included
ATTNPLUG_VEXP_ATTR inline vf vexp(vf x) {
  vf xc = x < splat(-87.0f) ? splat(-87.0f) : x;
  vf t = xc * 1.44269504088896341f + 0.5f;
  vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
  n = n > t ? n - 1.0f : n;  // floor
  vf r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vu e = __builtin_convertvector(__builtin_convertvector(n, vi) + 127, vu) << 23;
  vf res = p * bits(e);
  res = x < splat(-87.0f) ? splat(0.0f) : res;
  return x == x ? res : x;
}
