fu_add_bench(train "train_*.c" LIBS fu_dag)
