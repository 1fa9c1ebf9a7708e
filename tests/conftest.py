import os
import sys

# The tests build tiny models locally; nothing may reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))
