"""Single controller, SPMD worker groups: ``Worker``, ``@register``, dispatch modes, backends."""

from tandem.controller.colocate import FusedWorker, Role
from tandem.controller.decorator import MethodSpec, register
from tandem.controller.dispatch import (
    ALL_TO_ALL,
    DISPATCH_MODES,
    DP_COMPUTE,
    ONE_TO_ALL,
    RANK_ZERO,
    DispatchError,
    DispatchMode,
    MeshRank,
    mesh_dispatch,
    register_dispatch_mode,
)
from tandem.controller.errors import WorkerDiedError, WorkerError
from tandem.controller.factory import (
    check_placement,
    create_colocated_group,
    create_role_groups,
    create_worker_group,
)
from tandem.controller.group import GroupFuture, RoleView, WorkerGroup
from tandem.controller.resource_pool import ResourcePool
from tandem.controller.worker import DistInfo, Worker

__all__ = [
    "ALL_TO_ALL",
    "DISPATCH_MODES",
    "DP_COMPUTE",
    "ONE_TO_ALL",
    "RANK_ZERO",
    "DispatchError",
    "DispatchMode",
    "DistInfo",
    "FusedWorker",
    "GroupFuture",
    "MeshRank",
    "MethodSpec",
    "ResourcePool",
    "Role",
    "RoleView",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "check_placement",
    "create_colocated_group",
    "create_role_groups",
    "create_worker_group",
    "mesh_dispatch",
    "register",
    "register_dispatch_mode",
]
