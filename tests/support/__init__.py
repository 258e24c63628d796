"""What the rig-based tests share: the fake switch (its table and the datapath the app
serves), the kernel's fakes, and the rig that drives the real NFShuntApp with them."""
import os

os.environ.setdefault("OSKEN_HUB_TYPE", "native")  # os-ken picks its hub when first imported (as controller.py)
