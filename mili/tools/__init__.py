"""What is not on the serving path: the benchmark (`mili bench`), the self-test (`mili selftest`), and the
Triton kernels' ahead-of-time compile checks (`python -m mili.tools.triton_checks.compile_check`)."""
