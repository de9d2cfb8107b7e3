"""A preload that starts a thread: a zygote must refuse to fork after importing it."""

import threading
import time

threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
