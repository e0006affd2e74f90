# Gap bridged: TRL async weight sync needs NCCL (CUDA only); tensors go through a file and /collective_rpc instead.
"""A `WeightTransferProtocol` for `AsyncGRPOTrainer` / `AsyncRPGTrainer` against a real `trl vllm-serve` on vLLM's CPU
build: TRL's own `/pause`, `/start_weight_update`, `/finish_weight_update` and `/resume` (through TRL's async
`VLLMClient`), and in place of the NCCL broadcast one safetensors file loaded by [`helpers.vllm_cpu.CPUWeightReceiver`]
on the server. Test code only: nothing in `rpg_trl` imports it. It keeps a CPU copy of every version it pushed
(`sent[v - 1]` is policy version `v`), for the tests' log-prob checks."""

from __future__ import annotations

import os
import tempfile


class FileWeightTransfer:
    def __init__(self, server_url: str, timeout: float = 60.0):
        from trl.experimental.async_grpo.vllm_client import VLLMClient

        self.vllm = VLLMClient(server_url, server_timeout=timeout)
        self.timeout = timeout
        self.sent: list[dict] = []

    def init_weight_transfer(self) -> None:
        self.vllm.wait_for_server_ready()
        if self.vllm.get_server_info()["weight_transfer_config"] is None:
            raise RuntimeError(f"The vLLM server at {self.vllm.server_url} has no weight-transfer engine.")

    def pause(self) -> None:
        self.vllm.pause(timeout=self.timeout)

    def send_weights(self, iterator) -> None:
        from safetensors.torch import save_file

        tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in iterator}
        self.vllm.start_weight_update(timeout=self.timeout)
        try:
            with tempfile.TemporaryDirectory(prefix="rpg-async-weights-") as folder:
                path = os.path.join(folder, "weights.safetensors")
                save_file(tensors, path)
                self._rpc("rpg_load_weights", path)
        finally:
            self.vllm.finish_weight_update(timeout=self.timeout)
        self._rpc("rpg_repack_lm_head")  # after vLLM's reload has packed the other weights
        self.sent.append(tensors)

    def _rpc(self, method: str, *args) -> None:
        import requests

        response = requests.post(
            f"{self.vllm.server_url}/collective_rpc", json={"method": method, "args": list(args)}, timeout=self.timeout
        )
        if response.status_code != 200:
            raise Exception(f"Request failed: {response.status_code}, {response.text}")

    def resume(self) -> None:
        self.vllm.resume(timeout=self.timeout)

    def destroy(self) -> None:
        pass
