"""One process of a 2-process gloo run shaped like the end of a training script: a DDP model (its C++ `Reducer` owns
the process group), all_gathers of temporary tensors (like `Trainer.store_flos` at the end of `train()`), then
`destroy_process_group()` (`Trainer.end()`) and exit. `hold` runs `rpg_trl.reliability.teardown.hold_process_group_until_exit`
first; `plain` does not (PyTorch's own teardown: on this 2-core CPU about 2 runs in 5 deadlocked or aborted at exit).

`rpg_trl/reliability/teardown.py` is loaded without the package's `__init__` (`failure_two_proc.import_alone`, from
this folder, the script's own)."""

import sys

import torch
import torch.distributed as dist
from failure_two_proc import import_alone


hold_process_group_until_exit = import_alone("teardown").hold_process_group_until_exit


def main(mode):
    dist.init_process_group("gloo")
    if mode == "hold":
        assert hold_process_group_until_exit()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
    for _ in range(5):
        gathered = [torch.zeros(3) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.ones(3))
        assert torch.equal(torch.stack(gathered), torch.ones(dist.get_world_size(), 3))
        del gathered
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
