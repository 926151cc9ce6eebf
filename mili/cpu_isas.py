"""The ISA paths of MILI's CPU kernels, by architecture and lowest first: what the engine's ``cpu_isa`` option offers
(mili/config.py) and what mili/kernels/cpu builds and chooses from. Torch-free, so the options read it cheaply."""

from __future__ import annotations

# x86-64: AVX2 + FMA + F16C; with (AVX-)VNNI; AVX-512 F/BW/VL; the AVX-512 build with its linears on AMX tiles.
# aarch64: Advanced SIMD; with the sdot dot product. none: no kernels, torch's ops (anywhere).
ORDER = {"x86_64": ("none", "avx2", "avx2-vnni", "avx512", "amx"), "aarch64": ("none", "neon", "neon-dot")}
ISAS = tuple(dict.fromkeys(isa for order in ORDER.values() for isa in order))
