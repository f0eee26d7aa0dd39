"""Colocated ("fused") roles: several role workers in one process per rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.controller.dispatch import MeshRank
from tandem.controller.worker import Worker, construct_worker


@dataclass(frozen=True)
class Role:
    """A role's worker class and its constructor arguments."""

    cls: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


class FusedWorker(Worker):
    """One process holding one worker object per role (e.g. actor + rollout + reference).

    Each role object shares this process's rank and rendezvous address; the group calls
    ``"<role>.<method>"``. Colocated roles can hand tensors to each other in memory.
    """

    def __init__(self, roles: dict[str, Role]) -> None:
        self.role_names = list(roles)
        for name, role in roles.items():
            setattr(self, name, construct_worker(role.cls, self.dist_info, role.args, role.kwargs))

    def _tandem_claim_master(self) -> tuple[str, int]:
        """Rank 0 hosts the rendezvous store (see :meth:`Worker._tandem_claim_master`); its roles,
        built before, take the address and the store, since they are the ones that join the group."""
        address = super()._tandem_claim_master()
        for name in self.role_names:
            role = getattr(self, name)
            role.__dict__["_tandem_dist_info"] = self.dist_info
            if "_tandem_store" in self.__dict__:
                role.__dict__["_tandem_store"] = self.__dict__["_tandem_store"]
        return address

    def _tandem_mesh_rank(self, mesh: str) -> MeshRank:
        for name in self.role_names:
            ranks = getattr(self, name).__dict__.get("_tandem_mesh_ranks", {})
            if mesh in ranks:
                return ranks[mesh]
        return super()._tandem_mesh_rank(mesh)

    def role(self, name: str) -> Any:
        return getattr(self, name)
