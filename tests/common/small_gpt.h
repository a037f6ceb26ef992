// The example GPT's configuration in the model-parallel tests: small enough for 4 processes on 2
// cores, every split even at tp 2 (4 heads, width 32, 4 * width 128, vocabulary 64).
#pragma once

#include "../../examples/common/gpt.h"

namespace tandem::testing {

inline examples::GPTConfig small_gpt() {
  examples::GPTConfig c;
  c.vocab = 64;
  c.context = 16;
  c.layers = 2;
  c.heads = 4;
  c.width = 32;
  return c;
}

}  // namespace tandem::testing
