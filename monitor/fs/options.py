"""The choices the filesystem side accepts, defined once.

No imports: monitor.agent.config (and so `ckptwatch agent --help`) and `ckptwatch scan` read these
without loading watchdog or ctypes.
"""

# File names treated as checkpoints (plus any path a hook event names).
CHECKPOINT_PATTERNS = ("*.pt", "*.pth", "*.bin", "*.ckpt", "*.safetensors", "*.distcp")

# --watch.mode: inotify where it works and polling where it fails, or one of them forced.
WATCH_MODES = ("auto", "inotify", "polling")

# --watch.attribution: how a writer is named (fanotify: the kernel; proc: a /proc scan).
ATTRIBUTIONS = ("auto", "fanotify", "proc")
