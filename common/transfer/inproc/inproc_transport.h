// InProcessTransport: a KvTransport whose peers live in the same process, for unit tests and
// for code that wants the transfer contract without a network.
//
// Every instance registers itself in a process-wide registry under a unique address
// ("inproc:<name>#<n>"). A write looks the peer up there, checks each op against the peer's
// registered region (not only against the descriptor) and memcpys the bytes in. The copy and
// the callback run on the sender's own worker thread, never inline in WriteAsync, so callers
// see the same asynchronous behaviour as with a real network backend.
//
// Threading: thread-safe; one worker thread per instance, asleep when idle.
// Errors: unknown/destroyed peer -> UNAVAILABLE, deregistered region -> NOT_FOUND, range outside
// the region -> INVALID_ARGUMENT (nothing written), deadline already passed -> DEADLINE_EXCEEDED,
// transport destroyed with the write still queued -> CANCELLED.
#pragma once

#include <memory>
#include <string>

#include "common/transfer/transfer.h"

namespace tandem::transfer {

std::unique_ptr<KvTransport> CreateInProcessTransport(std::string name);

}  // namespace tandem::transfer
