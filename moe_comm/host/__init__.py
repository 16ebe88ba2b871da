"""Host (CPU) backend: ranks are processes on one machine sharing /dev/shm segments."""
