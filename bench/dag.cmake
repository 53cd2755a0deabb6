fu_add_bench(dag "train_*.c" LIBS fu_dag)
