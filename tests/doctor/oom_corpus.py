"""The corpus of OOM messages `doctor oom` is held to: each with its parsed numbers, the account of
the GPU and the verdict a person reading the numbers would reach.

Sources: PyTorch's format strings (c10/cuda/CUDACachingAllocator.cpp of 2.0 and 2.1+,
c10/xpu/XPUCachingAllocator.cpp, the MPS allocator); the seeds (notebook 000, verbatim in
tests/fixtures/doctor/seed_000_oom.txt; guide 003's exercise 9.2); messages quoted in public
repositories and issues (marked "public", verbatim); and synthetic messages built with PyTorch's
format for the situations issue 14 names (a PID namespace, the torch <= 2.0 form with memory held
elsewhere). Messages captured on an H100 by bench/gpu_doctor.py and bench/gpu_oom.py are checked in
test_doctor_gpu_fixtures.py against the truth recorded at the failure.

Each entry: ``id``, ``text``, ``fields`` (parsed numbers; None: absent), ``diagnosis``, and
optionally ``certain`` (default True), ``self_pid`` / ``self_source`` (which process the account
takes for this one, and how), ``others`` (bytes held by the other processes in the account).
"""
from __future__ import annotations

from fractions import Fraction

from doctor_support import FIXTURES

_UNIT = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def b(text: str) -> int:
    """'15.57 GiB' -> bytes, rounded half-even (independent of memlens' parser)."""
    num, unit = text.split()
    return round(Fraction(num) * _UNIT[unit])


SEED_000 = (FIXTURES / "seed_000_oom.txt").read_text()

CORPUS: list[dict] = [
    dict(id="seed_000_two_other_processes", text=SEED_000, fields=dict(
        form="torch>=2.1", device_type="cuda", device_index=0, requested_bytes=16777216,
        total_capacity_bytes=16718160200, free_bytes=b("23.06 MiB"), allowed_bytes=None,
        allocated_by_pytorch_bytes=b("413.55 MiB"), reserved_unallocated_bytes=b("12.45 MiB"),
        this_process_bytes=b("510.00 MiB"), private_pools_bytes=None,
        other_processes=[(3859131, b("12.57 GiB")), (3880458, b("2.10 GiB"))]),
        diagnosis="other_processes", self_source="message", others=b("12.57 GiB") + b("2.10 GiB")),
    dict(id="seed_003_exercise_9_2_wrapped", text="RuntimeError: CUDA out of memory. Tried to allocate 2.50 GiB \n"
         "(GPU 0; 23.69 GiB total capacity; 21.45 GiB already allocated; \n1.89 GiB free; 21.50 GiB reserved in total by PyTorch)",
         fields=dict(form="torch<=2.0", device_type="cuda", device_index=0, requested_bytes=2684354560,
                     total_capacity_bytes=25436943811, free_bytes=b("1.89 GiB"), allowed_bytes=None,
                     allocated_by_pytorch_bytes=b("21.45 GiB"), reserved_unallocated_bytes=b("21.50 GiB") - b("21.45 GiB"),
                     this_process_bytes=None, other_processes=[]),
         diagnosis="capacity", self_source="unknown"),
    # public (a 2.0 message quoted in a repository): PyTorch holds 188 MiB of a 7.93 GiB GPU, 7.70 GiB is
    # held elsewhere; the 57.65 MiB cached + 47.06 MiB free would cover the 36 MiB, but that is not why it failed
    dict(id="torch_2_0_public_held_elsewhere", text="RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; "
         "7.93 GiB total capacity; 130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) If "
         "reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for "
         "Memory Management and PYTORCH_CUDA_ALLOC_CONF",
         fields=dict(form="torch<=2.0", requested_bytes=b("36.00 MiB"), total_capacity_bytes=b("7.93 GiB"),
                     free_bytes=b("47.06 MiB"), allocated_by_pytorch_bytes=b("130.35 MiB"),
                     reserved_unallocated_bytes=b("188.00 MiB") - b("130.35 MiB")),
         diagnosis="held_elsewhere"),
    # issue 14: "8 GiB held elsewhere on a 10.76 GiB GPU came out as fragmentation" (torch <= 2.0 form)
    dict(id="torch_2_0_issue14_held_elsewhere", text="RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; "
         "10.76 GiB total capacity; 1.95 GiB already allocated; 301.69 MiB free; 2.36 GiB reserved in total by PyTorch)",
         fields=dict(form="torch<=2.0", total_capacity_bytes=b("10.76 GiB"), free_bytes=b("301.69 MiB"),
                     reserved_unallocated_bytes=b("2.36 GiB") - b("1.95 GiB")),
         diagnosis="held_elsewhere"),
    dict(id="torch_2_0_allowed", text="torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB (GPU 1; "
         "39.39 GiB total capacity; 17.50 GiB already allocated; 20.88 GiB free; 19.69 GiB allowed; 17.52 GiB reserved in "
         "total by PyTorch)",
         fields=dict(form="torch<=2.0", device_index=1, requested_bytes=4 * 2**30, allowed_bytes=b("19.69 GiB"),
                     reserved_unallocated_bytes=b("17.52 GiB") - b("17.50 GiB")),
         diagnosis="memory_fraction_limit"),
    dict(id="torch_2_1_0_capacty_typo", text="torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. "
         "GPU 0 has a total capacty of 7.79 GiB of which 1024 bytes is free. Process 2310 has 3.00 GiB memory in use. Including "
         "non-PyTorch memory, this process has 4.78 GiB memory in use. Of the allocated memory 4.51 GiB is allocated by "
         "PyTorch, and 102.94 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
         "setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
         fields=dict(form="torch>=2.1", requested_bytes=20 * 2**20, total_capacity_bytes=b("7.79 GiB"), free_bytes=1024,
                     allocated_by_pytorch_bytes=b("4.51 GiB"), reserved_unallocated_bytes=b("102.94 MiB"),
                     this_process_bytes=b("4.78 GiB"), other_processes=[(2310, 3 * 2**30)]),
         diagnosis="other_processes", self_source="message", others=3 * 2**30),
    dict(id="torch_2_4_allowed_private_pools", text="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 10.00 GiB. "
         "GPU 0 has a total capacity of 79.10 GiB of which 45.20 GiB is free. Including non-PyTorch memory, this process has "
         "33.89 GiB memory in use. 39.55 GiB allowed; Of the allocated memory 32.50 GiB is allocated by PyTorch, with 2.00 GiB "
         "allocated in private pools (e.g., CUDA Graphs), and 857.00 MiB is reserved by PyTorch but unallocated. If reserved "
         "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. "
         " See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
         fields=dict(form="torch>=2.1", requested_bytes=10 * 2**30, allowed_bytes=b("39.55 GiB"), private_pools_bytes=2 * 2**30,
                     allocated_by_pytorch_bytes=b("32.50 GiB"), reserved_unallocated_bytes=b("857.00 MiB"),
                     this_process_bytes=b("33.89 GiB"), other_processes=[]),
         diagnosis="memory_fraction_limit"),
    dict(id="torch_2_1_fragmentation_kib", text="CUDA out of memory. Tried to allocate 128.00 MiB. GPU 0 has a total capacity "
         "of 23.65 GiB of which 3.50 KiB is free. Including non-PyTorch memory, this process has 23.64 GiB memory in use. Of "
         "the allocated memory 11.20 GiB is allocated by PyTorch, and 11.90 GiB is reserved by PyTorch but unallocated.",
         fields=dict(requested_bytes=128 * 2**20, free_bytes=3584, reserved_unallocated_bytes=b("11.90 GiB")),
         diagnosis="fragmentation", self_source="message", others=0),
    dict(id="torch_2_1_zero_bytes_no_nvml", text="CUDA out of memory. Tried to allocate 2.00 MiB. GPU 3 has a total capacity "
         "of 14.75 GiB of which 0 bytes is free. Of the allocated memory 14.10 GiB is allocated by PyTorch, and 0 bytes is "
         "reserved by PyTorch but unallocated.",
         fields=dict(device_index=3, requested_bytes=2 * 2**20, free_bytes=0, reserved_unallocated_bytes=0,
                     this_process_bytes=None),
         diagnosis="capacity", self_source="unknown"),
    # issue 14's container: the training process itself printed under its host PID, no "this process"
    # line; 22.33 GiB = 17.10 allocated + 4.71 cached + a 0.52 GiB context: alone and fragmented
    dict(id="container_alone_fragmented", text="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 "
         "has a total capacity of 23.65 GiB of which 1.19 GiB is free. Process 48213 has 22.33 GiB memory in use. Of the "
         "allocated memory 17.10 GiB is allocated by PyTorch, and 4.71 GiB is reserved by PyTorch but unallocated. If reserved "
         "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.",
         fields=dict(this_process_bytes=None, other_processes=[(48213, b("22.33 GiB"))]),
         diagnosis="fragmentation", self_pid=48213, self_source="matched", others=0),
    # public (chatdoc-com/OCRFlux#42, `docker run --gpus '"device=3"'`): three processes listed, none as
    # "this process"; 30427's 31.20 GiB = 30.21 + 0.21 reserved + a 0.78 GiB context is this one, the two
    # others hold 8.15 GiB of the 39.39 GiB GPU
    dict(id="container_shared_public_ocrflux", text="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. "
         "GPU 0 has a total capacity of 39.39 GiB of which 9.25 MiB is free. Process 25454 has 3.86 GiB memory in use. Process "
         "104554 has 4.29 GiB memory in use. Process 30427 has 31.20 GiB memory in use. Of the allocated memory 30.21 GiB is "
         "allocated by PyTorch, with 26.00 MiB allocated in private pools (e.g., CUDA Graphs), and 217.48 MiB is reserved by "
         "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  "
         "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
         fields=dict(private_pools_bytes=26 * 2**20, this_process_bytes=None,
                     other_processes=[(25454, b("3.86 GiB")), (104554, b("4.29 GiB")), (30427, b("31.20 GiB"))]),
         diagnosis="other_processes", self_pid=30427, self_source="matched", others=b("3.86 GiB") + b("4.29 GiB")),
    # two copies of one job in two containers on one GPU: either could be this one, the verdict is the same
    dict(id="container_two_candidates_same_verdict", text="CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total "
         "capacity of 79.18 GiB of which 2.50 GiB is free. Process 111 has 38.20 GiB memory in use. Process 222 has 38.30 GiB "
         "memory in use. Of the allocated memory 36.80 GiB is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but "
         "unallocated.",
         fields=dict(this_process_bytes=None, other_processes=[(111, b("38.20 GiB")), (222, b("38.30 GiB"))]),
         diagnosis="other_processes", self_source="ambiguous", certain=True),
    # the only listed process holds 28 GiB, PyTorch 8 GiB: it is this one with 20 GiB outside PyTorch, or
    # another process while this one is not listed; the message cannot tell and the verdicts differ
    dict(id="container_one_listed_cannot_tell", text="CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
         "capacity of 44.39 GiB of which 512.00 MiB is free. Process 77 has 28.00 GiB memory in use. Of the allocated memory "
         "7.80 GiB is allocated by PyTorch, and 204.00 MiB is reserved by PyTorch but unallocated.",
         fields=dict(this_process_bytes=None, other_processes=[(77, 28 * 2**30)]),
         diagnosis="non_pytorch_memory", self_source="ambiguous", certain=False),
    # the same on a 23.65 GiB GPU: "none of them" cannot balance (0.5 + 22.9 + 8.0 > 23.65), so 77 is this one
    dict(id="container_one_listed_by_elimination", text="CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
         "capacity of 23.65 GiB of which 512.00 MiB is free. Process 77 has 22.90 GiB memory in use. Of the allocated memory "
         "7.80 GiB is allocated by PyTorch, and 204.00 MiB is reserved by PyTorch but unallocated.",
         fields=dict(this_process_bytes=None),
         diagnosis="non_pytorch_memory", self_pid=77, self_source="matched", others=0),
    # a container under a memory fraction: the listed process is this one, the cap is the cause
    dict(id="container_memory_fraction", text="CUDA out of memory. Tried to allocate 23.75 GiB. GPU 0 has a total capacity of "
         "79.18 GiB of which 54.91 GiB is free. Process 1934 has 24.26 GiB memory in use. 39.59 GiB allowed; Of the allocated "
         "memory 23.75 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.",
         fields=dict(allowed_bytes=b("39.59 GiB"), this_process_bytes=None, other_processes=[(1934, b("24.26 GiB"))]),
         diagnosis="memory_fraction_limit", self_pid=1934, self_source="matched", others=0),
    # this process holds 20 GiB outside PyTorch (another framework, NCCL): not fragmentation, not capacity
    dict(id="non_pytorch_memory", text="CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 39.39 "
         "GiB of which 500.00 MiB is free. Including non-PyTorch memory, this process has 38.88 GiB memory in use. Of the "
         "allocated memory 18.50 GiB is allocated by PyTorch, and 400.00 MiB is reserved by PyTorch but unallocated.",
         fields=dict(this_process_bytes=b("38.88 GiB")), diagnosis="non_pytorch_memory", self_source="message", others=0),
    # nobody listed holds it: a process in another container (invisible to this one's driver queries)
    dict(id="held_elsewhere_unlisted", text="CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of "
         "79.18 GiB of which 300.00 MiB is free. Including non-PyTorch memory, this process has 40.00 GiB memory in use. Of "
         "the allocated memory 39.00 GiB is allocated by PyTorch, and 500.00 MiB is reserved by PyTorch but unallocated.",
         fields=dict(this_process_bytes=40 * 2**30), diagnosis="held_elsewhere", self_source="message", others=0),
    # public (quoted in a repository's notes): "this process" printed before the other process
    dict(id="public_this_process_first", text="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.16 GiB.\n"
         "GPU 0 has a total capacity of 31.36 GiB of which 471.69 MiB is free.\nIncluding non-PyTorch memory, this process "
         "has 16.63 GiB memory in use.\nProcess 19239 has 14.26 GiB memory in use.\nOf the allocated memory 15.03 GiB is "
         "allocated by PyTorch, and 1.00 GiB\nis reserved by PyTorch but unallocated.",
         fields=dict(this_process_bytes=b("16.63 GiB"), other_processes=[(19239, b("14.26 GiB"))]),
         diagnosis="other_processes", self_source="message", others=b("14.26 GiB")),
    # public: a 458 MiB neighbour is not blamed for a 876 MiB request on a full 23.68 GiB GPU
    dict(id="public_small_neighbour_not_blamed", text="CUDA OOM: CUDA out of memory. Tried to allocate 876.00 MiB. GPU 0 has "
         "a total capacity of 23.68 GiB of which 251.06 MiB is free. Process 2612630 has 458.00 MiB memory in use. Including "
         "non-PyTorch memory, this process has 22.98 GiB memory in use. Of the allocated memory 22.65 GiB is allocated by "
         "PyTorch, and 77.68 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
         "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.",
         fields=dict(other_processes=[(2612630, 458 * 2**20)]), diagnosis="capacity", self_source="message",
         others=458 * 2**20),
    # public: a message cut before PyTorch's figures; 8.06 GiB in another process on a full 44.39 GiB GPU
    dict(id="public_truncated_other_process", text="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 298.00 MiB.\n"
         "GPU 0 has a total capacity of 44.39 GiB of which 12.06 MiB is free.\nProcess 6324 has 8.06 GiB memory in use.\n"
         "Including non-PyTorch memory, this process has 36.30 GiB memory in use.",
         fields=dict(allocated_by_pytorch_bytes=None, reserved_unallocated_bytes=None, this_process_bytes=b("36.30 GiB")),
         diagnosis="other_processes", self_source="message", others=b("8.06 GiB")),
    # public (2.1.0 "capacty"): an 8 GiB request, 7.11 GiB free, a 256 MiB neighbour: the job is too big
    dict(id="public_capacty_too_big", text="CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacty of "
         "23.69 GiB of which 7.11 GiB is free. Process 2006998 has 256.00 MiB memory in use. Including non-PyTorch memory, "
         "this process has 16.31 GiB memory in use. Of the allocated memory 16.01 GiB is allocated by PyTorch, and 7.47 MiB "
         "is reserved by PyTorch but unallocated.",
         fields=dict(requested_bytes=8 * 2**30, other_processes=[(2006998, 256 * 2**20)]), diagnosis="capacity",
         self_source="message"),
    # public (a Kaggle notebook's notes): a 1.81 GiB neighbour on a 15.56 GiB GPU covers the 0.61 GiB missing
    dict(id="public_kaggle_neighbour", text="OutOfMemoryError: CUDA out of memory. Tried to allocate 1.98 GiB. \nGPU 0 has a "
         "total capacity of 15.56 GiB of which 1.37 GiB is free. \nProcess 6680 has 1.81 GiB memory in use. \nIncluding "
         "non-PyTorch memory, this process has 11.21 GiB memory in use. \nOf the allocated memory 9.46 GiB is allocated by "
         "PyTorch, and 1.51 GiB is reserved by PyTorch but unallocated.",
         fields=dict(other_processes=[(6680, b("1.81 GiB"))]), diagnosis="other_processes", self_source="message"),
    dict(id="hip", text="torch.OutOfMemoryError: HIP out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of "
         "63.98 GiB of which 1.21 GiB is free. Of the allocated memory 61.20 GiB is allocated by PyTorch, and 1.02 GiB is "
         "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
         "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True",
         fields=dict(device_type="hip", requested_bytes=b("1.95 GiB"), free_bytes=b("1.21 GiB")), diagnosis="fragmentation"),
    dict(id="xpu_old_no_free", text="XPU out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 64.00 GiB. "
         "Of the allocated memory 62.50 GiB is allocated by PyTorch, and 512.00 MiB is reserved by PyTorch but unallocated. "
         "Please use `empty_cache` to release all unoccupied cached memory.",
         fields=dict(form="torch>=2.1", device_type="xpu", requested_bytes=2**30, total_capacity_bytes=64 * 2**30,
                     free_bytes=None, allocated_by_pytorch_bytes=b("62.50 GiB"), reserved_unallocated_bytes=512 * 2**20),
         diagnosis="capacity"),
    dict(id="xpu_new_allowed", text="XPU out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 48.00 GiB "
         "of which 30.00 GiB is free. 24.00 GiB allowed; Of the allocated memory 18.00 GiB is allocated by PyTorch, and 0 "
         "bytes is reserved by PyTorch but unallocated. Please use `empty_cache` to release all unoccupied cached memory.",
         fields=dict(device_type="xpu", allowed_bytes=24 * 2**30, free_bytes=30 * 2**30), diagnosis="memory_fraction_limit"),
    dict(id="generic_out_of_memory", text="torch.OutOfMemoryError: Out of memory. Tried to allocate 4.00 GiB. GPU 0 has a "
         "total capacity of 79.19 GiB of which 2.06 GiB is free. Including non-PyTorch memory, this process has 77.12 GiB "
         "memory in use. Of the allocated memory 74.00 GiB is allocated by PyTorch, and 2.50 GiB is reserved by PyTorch but "
         "unallocated.",
         fields=dict(device_type=None, requested_bytes=4 * 2**30, reserved_unallocated_bytes=b("2.50 GiB")),
         diagnosis="fragmentation", self_source="message", others=0),
    dict(id="mps_watermark", text="RuntimeError: MPS backend out of memory (MPS allocated: 18.04 GB, other allocations: "
         "7.27 MB, max allowed: 18.13 GB). Tried to allocate 256.00 MB on private pool. Use "
         "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may cause system failure).",
         fields=dict(form="mps", device_type="mps", requested_bytes=256 * 2**20, allocated_by_pytorch_bytes=b("18.04 GiB"),
                     mps_other_allocations_bytes=b("7.27 MiB"), allowed_bytes=b("18.13 GiB")),
         diagnosis="memory_fraction_limit"),
    dict(id="mps_under_watermark", text="RuntimeError: MPS backend out of memory (MPS allocated: 2.10 GB, other "
         "allocations: 5.30 GB, max allowed: 36.27 GB). Tried to allocate 1.00 GB on private pool.",
         fields=dict(form="mps", allocated_by_pytorch_bytes=b("2.10 GiB"), mps_other_allocations_bytes=b("5.30 GiB")),
         diagnosis="capacity"),
    dict(id="cuda_error_no_numbers", text="RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
         "reported at some other API call, so the stacktrace below might be incorrect.",
         fields=dict(form="cuda_error", requested_bytes=None, total_capacity_bytes=None), diagnosis="unknown", certain=False),
]

BY_ID = {c["id"]: c for c in CORPUS}


def text(case_id: str) -> str:
    return BY_ID[case_id]["text"]
