"""The data plane: data connections (:mod:`ps_common.dataconn`) beside gRPC, and PushPull over them."""
