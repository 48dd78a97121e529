"""The curriculum: reward-variance task statistics and selection as pure functions over a fixed-size pytree
(`state`), the task pool (`pool`), M_task's variant generation (`task_gen`), k-means task groups for PPO (`clusters`),
and the task sources an RL iteration draws from (`source`: UniformTasks, CurriculumTasks). Nothing is re-exported:
import the modules."""
