// tandem: distributed training for LibTorch. The umbrella header.
#pragma once

#include "tandem/accelerator.h"
#include "tandem/comm/collectives.h"
#include "tandem/comm/process_group.h"
#include "tandem/data/loader.h"
#include "tandem/data/sampler.h"
#include "tandem/optimizer.h"
#include "tandem/parallel/activation_checkpoint.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/sharded.h"
#include "tandem/parallel/strategy.h"
#include "tandem/parallel/zero.h"
#include "tandem/state.h"
#include "tandem/track/cpu_memory.h"
#include "tandem/track/progress.h"
#include "tandem/version.h"
