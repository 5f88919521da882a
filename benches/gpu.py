"""Peak GPU memory of a child process, for the `--device cuda` comparisons (sample_compare.py, grpo_compare.py).

The figure is the rise of the GPU's used memory as the driver reports it (`nvidia-smi --query-gpu=memory.used`,
polled every 0.1 s) over its level before the process started: the same measure for torch and for candle,
each allocator's cache and the CUDA context included. Process ids are not used: in a container
`nvidia-smi` may not see them. Nothing else may use the GPU meanwhile.
"""
import subprocess
import threading


def used_mib(gpu=0):
    out = subprocess.run(["nvidia-smi", f"--id={gpu}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[0])


class PeakMemory:
    """`with PeakMemory() as peak: ...`, then `peak.mib`: the most used memory above the level at entry."""

    def __init__(self, gpu=0, interval_s=0.1):
        self.gpu, self.interval_s = gpu, interval_s
        self.mib = 0.0

    def __enter__(self):
        self.baseline = used_mib(self.gpu)
        self.highest = self.baseline
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while not self.done.wait(self.interval_s):
            self.highest = max(self.highest, used_mib(self.gpu))

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.highest = max(self.highest, used_mib(self.gpu))
        self.mib = self.highest - self.baseline
        return False
