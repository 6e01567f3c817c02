"""loraplane's services.

gRPC's fork support is turned off before anything imports grpc: these processes never
use gRPC in a forked child, they only fork to exec (`services.stack.process` starts every
child with a pre-exec step, which forces a real fork). With it on, a fork while other
threads are inside gRPC skips its fork handlers and the child can abort (SIGABRT) before
it execs: about 3 in 100 children of a process streaming over gRPC died that way.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
