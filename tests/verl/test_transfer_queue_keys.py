"""verl's data-plane keys (``transfer_queue.*``): its transfer queue becomes tandem's data plane,
in shared memory on one node and in Ray's object store across several; its storage settings are
noted. The typed config accepts each translation."""

from __future__ import annotations

from tandem.verl.translate import translate
from tests.verl.test_keys import BASE


def _settings(args: list[str]) -> tuple[dict[str, str], list[str], object]:
    translation = translate([*BASE, *args])
    return (
        dict(item.split("=", 1) for item in translation.overrides),
        list(translation.notes),
        translation.config(),
    )


def test_the_transfer_queue_becomes_the_data_plane_on_shared_memory_on_one_node():
    settings, _, config = _settings(["transfer_queue.enable=true"])
    assert settings["dataplane.enabled"] == "true" and "dataplane.engine" not in settings
    assert config.dataplane.enabled and config.dataplane.engine == "shm"


def test_across_nodes_the_data_plane_lives_in_rays_object_store():
    settings, _, config = _settings(["transfer_queue.enable=true", "trainer.nnodes=2"])
    assert settings["dataplane.engine"] == "ray" and settings["trainer.backend"] == "ray"
    assert config.dataplane.enabled and config.dataplane.engine == "ray" and config.trainer.backend == "ray"


def test_without_the_transfer_queue_the_data_plane_keeps_its_default_and_its_storage_keys_are_noted():
    settings, notes, config = _settings(
        ["trainer.nnodes=2", "transfer_queue.storage_backend=AsyncSimpleStorageManager",
         "transfer_queue.num_data_storage_units=8", "transfer_queue.num_global_batch=1"]
    )  # fmt: skip
    # tandem's data plane is on by default; across nodes its blocks go to Ray's object store
    assert {k: v for k, v in settings.items() if k.startswith("dataplane.")} == {"dataplane.engine": "ray"}
    assert config.dataplane.enabled and config.dataplane.engine == "ray"
    for key in ("storage_backend", "num_data_storage_units", "num_global_batch"):
        assert any(note.startswith(f"transfer_queue.{key}:") for note in notes), key
