fu_add_bench(guest "guest_*.c" LIBS fu_peer)
