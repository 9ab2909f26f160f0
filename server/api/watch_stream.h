// WatchModel's server side: one gRPC callback write-reactor per stream, fed
// by the registry's event hub (server/model/model_events.h). A waiting stream
// holds no thread: the hub's one thread and gRPC's callback threads move
// its events, one write in flight at a time.
//
// The stream ends with the watcher's reason (RESOURCE_EXHAUSTED when it fell
// behind, UNAVAILABLE when the daemon stops) or CANCELLED when the client
// goes away. At shutdown a stream whose write is stuck behind a client that
// does not read is cancelled, so the server's Shutdown does not wait for it.
#ifndef WEIGHTD_SERVER_API_WATCH_STREAM_H_
#define WEIGHTD_SERVER_API_WATCH_STREAM_H_

#include <grpcpp/grpcpp.h>

#include "server/registry/registry.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {

// The initial metadata a stream sends once it is subscribed (docs/api.md
// "WatchModel"): clients wait for it, so no later event can be missed.
inline constexpr char kWatchSubscribedKey[] = "weightd-watch";
inline constexpr char kWatchSubscribedValue[] = "subscribed";

// Starts a stream of `request`'s events for `context`; the reactor deletes
// itself when the call is done. `registry` must outlive every stream (the
// daemon shuts its servers down before destroying the registry).
grpc::ServerWriteReactor<v1::ModelEvent>* StartWatchStream(grpc::CallbackServerContext* context,
                                                           const v1::WatchModelRequest& request,
                                                           ModelRegistry* registry);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_API_WATCH_STREAM_H_
