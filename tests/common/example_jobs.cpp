// main() of an example's test build (<example>_jobs, tests/CMakeLists.txt): the example's own
// object files, linked with -Wl,--wrap=main, so that its main is __real_main and this is the
// program's entry. `<example>_jobs --jobs FILE` runs the file's jobs one after another in one
// process (tests/common/jobs_main.h, tests/oracle/common.py's launch_jobs): the tests against the
// Python tools train a dozen layouts each, and starting LibTorch is most of a short job's time.
// Any other arguments go to the example unchanged.
#include "jobs_main.h"

extern "C" int __real_main(int argc, char** argv);

extern "C" int __wrap_main(int argc, char** argv) {
  return tandem::testing::main_with_jobs(argc, argv, __real_main);
}
