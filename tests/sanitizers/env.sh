# Sourced by scripts/test.sh for a sanitizer build (TANDEM_SANITIZE=address or thread): the
# runtime options of every tandem program the tests start, the launcher's ranks included (they
# inherit the environment). The suppression files beside this one say why each entry exists.
_tandem_san_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# ASan: stop at the first error with a full report; leaks are checked at exit (LSan), with the
# suppressions of lsan.supp for LibTorch's own process-lifetime allocations.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1:detect_stack_use_after_return=0:check_initialization_order=1:strict_init_order=0:print_summary=1"
export LSAN_OPTIONS="suppressions=${_tandem_san_dir}/lsan.supp:print_suppressions=0"
# UBSan: every finding is fatal (the build also passes -fno-sanitize-recover=undefined).
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# TSan: LibTorch and its OpenMP runtime are not instrumented; tsan.supp names what that hides.
export TSAN_OPTIONS="suppressions=${_tandem_san_dir}/tsan.supp:halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0"
unset _tandem_san_dir
