/* What this CPU and its OS let a program run, as CPUID (x86-64) or the kernel's hwcaps (aarch64) say: one
 * "name 0|1" line per feature, named as /proc/cpuinfo names them, into buf. Built with no ISA flags and loaded
 * (in process: an emulator runs it as the guest) once per process by mili/kernels/cpu/__init__.py, which picks
 * the kernels' ISA from it. /proc/cpuinfo alone is not enough: under an emulator (qemu-user -cpu Haswell) it
 * shows the host's flags, while CPUID is the guest's. */
#include <stdio.h>

static char *out;
static int left;
static void say(const char *name, int bit) {
  const int n = snprintf(out, left, "%s %d\n", name, bit ? 1 : 0);
  if (n > 0 && n < left) out += n, left -= n;
}

#if defined(__x86_64__)
#define SAY(flag, name) say(flag, __builtin_cpu_supports(name))
int mili_cpu_probe(char *buf, int len) {
  out = buf, left = len;
  __builtin_cpu_init(); /* gcc's checks include the OS's (XCR0) consent to the AVX and AVX-512 state */
  SAY("avx2", "avx2");
  SAY("fma", "fma");
  SAY("f16c", "f16c");
  SAY("avx512f", "avx512f");
  SAY("avx512bw", "avx512bw");
  SAY("avx512vl", "avx512vl");
  SAY("avx512dq", "avx512dq");
  SAY("avx512_vnni", "avx512vnni");
  SAY("avx512_bf16", "avx512bf16");
  SAY("avx_vnni", "avxvnni");
  SAY("amx_tile", "amx-tile");
  SAY("amx_bf16", "amx-bf16");
  SAY("amx_int8", "amx-int8");
  return 0;
}
#elif defined(__aarch64__)
#include <sys/auxv.h>
int mili_cpu_probe(char *buf, int len) {
  out = buf, left = len;
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  say("asimd", (hw >> 1) & 1);    /* HWCAP_ASIMD */
  say("asimddp", (hw >> 20) & 1); /* HWCAP_ASIMDDP: sdot/udot */
  say("i8mm", (hw2 >> 13) & 1);   /* HWCAP2_I8MM */
  say("bf16", (hw2 >> 14) & 1);   /* HWCAP2_BF16 */
  return 0;
}
#else
int mili_cpu_probe(char *buf, int len) {
  (void)say;
  if (len > 0) buf[0] = 0;
  return 0;
}
#endif
