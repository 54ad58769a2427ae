// The model the request fuzz targets validate against: a tiny llama GGUF (tests/fakes) written
// once per process to a temp file, loaded as the router loads its model. Aborts when it cannot
// be made (the target would test nothing).
#pragma once

#include "services/router/router_model.h"

namespace tandem::fuzz {

const router::RouterModel& FuzzModel();

}  // namespace tandem::fuzz
