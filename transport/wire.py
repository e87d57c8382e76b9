"""Every msgpack extension code in asyncrl, in one table.

Codes are one table so two layers can never pick the same number; upper layers import their
code from here (transport never imports them) and register their types with
`transport.codec.register_type` or, for a typed message, `@transport.codec.message(CODE)`.
"""

from __future__ import annotations

import enum


class Ext(enum.IntEnum):
    """msgpack extension codes. 0..15 belong to transport's own codec."""

    TENSOR = 1
    NDARRAY = 2
    BLOB = 3
    DTYPE = 4
    INLINE_TENSOR = 5
    # objectstore
    OBJECT_REF = 16
    # asyncrl
    BATCH = 17
    DIST_BATCH = 18
    PROMISED = 19  # a pipelined call's input (asyncrl.single_controller.pipeline)
    # objectstore pull messages
    PULL_REQUEST = 20
    TENSOR_REGION = 21
    SHM_REPLY = 22
    TCP_REPLY = 23
    CUDA_IPC_REPLY = 24
    # daemons control messages
    NODE_REGISTRATION = 32
    WORKER_SPEC = 33
    WORKER_READY = 34
    WORKER_EXIT = 35
    NODE_STATUS = 36
    WORKER_STATUS = 37
    CLUSTER_STATUS = 38
    NODE_INFO = 39
    CHILD_STATUS = 40
    JOB_STATUS = 41


FIRST_USER_CODE = 16
