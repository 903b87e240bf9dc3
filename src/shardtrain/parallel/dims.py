"""`ParallelDims`: the sizes of every parallel dimension, validated once, and the device meshes named by purpose.

    dims = ParallelDims.resolve(world_size=4, cp=2)            # dp_shard takes the rest: 2
    meshes = dims.build("cpu")                                 # DeviceMesh ((pp,) dp_replicate, dp_shard, cp, tp)
    meshes.fsdp, meshes.batch, meshes.loss, meshes.cp          # what each consumer needs

Ranks are laid out as torchtitan's: (pp, dp_replicate, dp_shard, cp, tp), tp innermost, so the ranks of one
context-parallel group are neighbours (on one node), pp outermost (a pipeline's stages may sit on different
nodes: they exchange only activations). The mesh has a pp dimension only when pp > 1. Purposes:

    pp     pp                             the pipeline's stages (point-to-point activations and gradients)
    batch  dp_replicate x dp_shard        ranks that see different samples (the batch plan, eval shares)
    fsdp   (dp_replicate,) dp_shard x cp  what `fully_shard` shards dense parameters over (2-D under HSDP)
    loss   (pp x) batch x cp              where (loss sum, token count) pairs are reduced (only a pipeline's
                                          last stage holds losses; the others add zeros)
    cp     cp                             sequence sharding and K/V gathering
    tp     tp                             tensor-parallel layers
    ep     ep (inside dp_shard x cp x tp) routed experts: each rank owns num_experts / ep of them
    efsdp  (dp_replicate,) dp_shard x cp x tp / ep   what `fully_shard` shards each rank's experts over

Expert parallelism borrows its ranks from dp_shard x cp x tp (torchtitan's layout): the ep ranks of one group are
neighbours (with tp, an ep group of size tp is the tp group: its ranks share a batch and split its tokens), and
the experts, not tensor-parallel themselves, are sharded further over the efsdp ranks that hold the same
experts. These two come from a second root mesh (dp_replicate, efsdp, ep) over the same ranks, so FSDP2 sees the
experts' ep mesh and their efsdp mesh as siblings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardtrain.config.fsdp_config import FSDPConfig
from shardtrain.errors import ParallelDimsError


@dataclass(kw_only=True, frozen=True)
class ParallelDims:
    """Validated sizes; `pp * dp_replicate * dp_shard * cp * tp == world_size`; `ep` divides `dp_shard * cp * tp`."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    world_size: int
    pp: int = 1

    @classmethod
    def resolve(cls, *, world_size: int, dp_replicate: int | None = None, dp_shard: int | None = None,
                cp: int = 1, tp: int = 1, ep: int = 1, pp: int = 1, fsdp_config: FSDPConfig | None = None,
                local_world_size: int | None = None) -> ParallelDims:
        """Fill in the sizes that are not given and check that they multiply to `world_size`.

        The data-parallel ranks (world / (pp * cp * tp)) are split into replicate x shard by, in order: explicit
        `dp_replicate`/`dp_shard` (a missing one takes the rest); the fsdp_config sharding strategy (no_shard:
        replicate only; hybrid: shard over `dp_shard_size`, default the node's ranks / (cp * tp)); the fsdp_config
        `dp_shard_size`; otherwise shard over all of them.

        Raises:
            ParallelDimsError: a size < 1, or sizes that do not multiply to the world size.
        """
        sizes = {"dp_replicate_size": dp_replicate, "dp_shard_size": dp_shard, "cp_size": cp, "tp_size": tp,
                 "ep_size": ep, "pp_size": pp}
        for name, value in sizes.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ParallelDimsError(f"parallel size {name} = {value!r} must be an int >= 1")
        given = ", ".join(f"{k}={v}" for k, v in sizes.items() if v not in (None, 1))
        if world_size % (pp * cp * tp):
            named = {"pp_size": pp, "cp_size": cp, "tp_size": tp} if pp > 1 else {"cp_size": cp, "tp_size": tp}
            raise ParallelDimsError(
                f"{' x '.join(named)} = {' x '.join(map(str, named.values()))} = {pp * cp * tp} does not divide the "
                f"{world_size} ranks; choose sizes whose product divides {world_size} (given: {given or 'defaults'})")
        if pp > 1 and cp > 1:
            raise ParallelDimsError(
                f"pp_size = {pp} with cp_size = {cp}: context parallelism inside pipeline stages is not implemented "
                "yet; set cp_size 1 (pp x dp x tp), or pp_size 1")
        if pp > 1 and ep > 1:
            raise ParallelDimsError(
                f"pp_size = {pp} with ep_size = {ep}: pipeline stages of a mixture-of-experts model are not "
                "implemented yet; set pp_size 1 (ep x fsdp x tp), or ep_size 1")
        data = world_size // (pp * cp * tp)
        config = fsdp_config or FSDPConfig()
        if dp_replicate is None and dp_shard is None:
            if config.replicate_only:
                dp_replicate, dp_shard = data, 1
            elif config.hybrid:
                node = (local_world_size or world_size) // (pp * cp * tp)
                dp_shard = config.dp_shard_size or max(node, 1)
            elif config.dp_shard_size is not None:
                dp_replicate, dp_shard = 1, config.dp_shard_size
        if dp_shard is None:
            dp_shard = data // (dp_replicate or 1)
        if dp_replicate is None:
            dp_replicate = data // dp_shard if data % dp_shard == 0 else 0
        if pp * dp_replicate * dp_shard * cp * tp != world_size:
            raise ParallelDimsError(
                f"parallel sizes {f'pp {pp} x ' if pp > 1 else ''}dp_replicate {dp_replicate or '?'} x dp_shard "
                f"{dp_shard} x cp {cp} x tp {tp} do not "
                f"multiply to the {world_size} ranks (given: {given or 'defaults'}); leave dp_shard_size unset so "
                f"that it takes the rest ({data} data-parallel ranks), use sharding_strategy 'hybrid_shard' to "
                f"replicate across shard groups, or make the product {world_size}")
        if (dp_shard * cp * tp) % ep:
            raise ParallelDimsError(
                f"ep_size = {ep} must divide dp_shard x cp x tp = {dp_shard * cp * tp} (experts are spread over "
                f"those ranks); choose a divisor of {dp_shard * cp * tp}")
        dims = cls(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, world_size=world_size, pp=pp)
        dims.check_reshard_size(config)
        return dims

    def check_reshard_size(self, config: FSDPConfig) -> None:
        """An int `reshard_after_forward` must divide every group `fully_shard` shards over (torch's rule).

        Raises:
            ParallelDimsError: naming the value, the group's size and the values that work.
        """
        value = config.reshard_after_forward
        if isinstance(value, bool) or not isinstance(value, int):
            return
        groups = {"dense parameters (dp_shard x cp)": self.dp_shard * self.cp}
        if self.ep > 1:
            groups["experts (dp_shard x cp x tp / ep)"] = self.efsdp
        for what, size in groups.items():
            if size % value:
                works = [d for d in range(2, size) if size % d == 0]
                fix = (f"one of {works}, " if works else "") + "true (reshard over all of them) or false"
                raise ParallelDimsError(
                    f"fsdp_config key 'reshard_after_forward' is {value}, which does not divide the {size} "
                    f"rank{'s' if size != 1 else ''} that shard the {what}; set it to {fix}")

    @property
    def batch_size(self) -> int:
        """Ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts and shard them (dp_shard x cp x tp / ep)."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def data_copies(self) -> int:
        """Ranks that read the same samples: the tensor-parallel ranks of every pipeline stage (pp x tp)."""
        return self.pp * self.tp

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (the world without a pipeline)."""
        return self.world_size // self.pp

    @property
    def grad_average_size(self) -> int:
        """Ranks FSDP averages dense gradients over (replicate x shard x cp)."""
        return self.dp_replicate * self.dp_shard * self.cp

    def rank_coords(self, rank: int) -> dict[str, int]:
        """Coordinates of global `rank` in the (pp, dp_replicate, dp_shard, cp, tp) layout, plus its batch index."""
        pp, rank = divmod(rank, self.stage_size)
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        replicate, shard = divmod(rest, self.dp_shard)
        return {"pp": pp, "dp_replicate": replicate, "dp_shard": shard, "cp": cp, "tp": tp,
                "batch": replicate * self.dp_shard + shard}

    def describe(self) -> str:
        parts = [f"pp {self.pp}"] if self.pp > 1 else []
        parts += [f"{name} {size}" for name, size in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                                                       ("cp", self.cp), ("tp", self.tp), ("ep", self.ep))]
        return " x ".join(parts) + f" = {self.world_size} ranks"

    def build(self, device_type: str) -> Meshes:
        """Create the world mesh and the flattened meshes of each purpose (collective: every rank calls it).
        Without a process group (one process sharding nothing), every purpose is a `OneProcessMesh`."""
        if not dist.is_initialized():
            if self.world_size != 1:
                raise RuntimeError(f"{self.describe()} needs a process group: call init_distributed() first")
            one = OneProcessMesh()
            return Meshes(dims=self, world=one, batch=one, fsdp=one, loss=one, cp=one, tp=one)
        names = ("dp_replicate", "dp_shard", "cp", "tp")
        shape = (self.dp_replicate, self.dp_shard, self.cp, self.tp)
        if self.pp > 1:
            names, shape = ("pp", *names), (self.pp, *shape)
        world = init_device_mesh(device_type, shape, mesh_dim_names=names)
        batch = world["dp_replicate", "dp_shard"]._flatten("batch")
        shard_cp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        fsdp = _hsdp_mesh(world, shard_cp) if self.dp_replicate > 1 else shard_cp
        loss = world[names[:-1]]._flatten("loss")  # (pp,) dp_replicate, dp_shard, cp
        ep = efsdp = None
        if self.ep > 1:  # same ranks, same order: rank = (replicate, efsdp, ep) row-major
            sparse = init_device_mesh(device_type, (self.dp_replicate, self.efsdp, self.ep),
                                      mesh_dim_names=("dp_replicate", "efsdp", "ep"))
            ep = sparse["ep"]
            efsdp = sparse["dp_replicate", "efsdp"] if self.dp_replicate > 1 else sparse["efsdp"]
        return Meshes(dims=self, world=world, batch=batch, fsdp=fsdp, loss=loss, cp=world["cp"], tp=world["tp"],
                      ep=ep, efsdp=efsdp, pp=world["pp"] if self.pp > 1 else None)


def _hsdp_mesh(world: DeviceMesh, shard_cp: DeviceMesh) -> DeviceMesh:
    """The 2-D (dp_replicate, dp_shard_cp) mesh FSDP uses for HSDP."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:  # torch >= 2.10: slicing a flattened dim from the root mesh is deprecated
        return concatenate([world["dp_replicate"], shard_cp])
    return world["dp_replicate", "dp_shard_cp"]


class OneProcessMesh:
    """The mesh of every purpose on a one-process run that shards nothing and so starts no process group (as
    transformers' Trainer on one process): one rank, no group; `collectives` skips what would run over it. Never
    handed to FSDP, TP or DTensor (a run that uses them starts a group)."""

    ndim = 1

    def size(self, mesh_dim: int | None = None) -> int:
        return 1

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        return 0

    def get_group(self, mesh_dim: int | str | None = None) -> None:
        return None


@dataclass(kw_only=True, frozen=True)
class Meshes:
    """The device meshes of one `ParallelDims`, by purpose (see the module docstring)."""

    dims: ParallelDims
    world: DeviceMesh
    batch: DeviceMesh
    fsdp: DeviceMesh
    loss: DeviceMesh
    cp: DeviceMesh
    tp: DeviceMesh
    ep: DeviceMesh | None = None
    efsdp: DeviceMesh | None = None
    pp: DeviceMesh | None = None

    @property
    def batch_rank(self) -> int:
        return self.batch.get_local_rank()
