"""Hand-made stage graphs and schedule orders shared by the planner and simulator tests."""
from dipc.plan import TensorSpec
from dipc.schedule import Edge, Stage, StageGraph

T = (TensorSpec("h", (2, 4), "float32"),)


def chain_graph(p, m, tf=1.0, tb=2.0):
    """m microbatches through p chunks, chunk r on rank r (uniform stages: forward tf, backward tb seconds)."""
    stages, edges = {}, []
    for mb in range(m):
        for c in range(p):
            for kind, lat in (("F", tf), ("B", tb)):
                s = Stage(kind, c, mb, -1, c, lat, priority=-mb)
                stages[s.key] = s
            edges.append(Edge(f"F:{c}:{mb}:-1", f"B:{c}:{mb}:-1"))
            if c:
                edges.append(Edge(f"F:{c-1}:{mb}:-1", f"F:{c}:{mb}:-1", T))
                edges.append(Edge(f"B:{c}:{mb}:-1", f"B:{c-1}:{mb}:-1", T))
    return StageGraph(stages, edges)


def gpipe_order(p, m):
    """GPipe: every forward, then every backward, on each rank."""
    return [[f"F:{r}:{i}:-1" for i in range(m)] + [f"B:{r}:{i}:-1" for i in range(m)] for r in range(p)]


def one_f_one_b_order(p, m):
    """1F1B: p - r - 1 warm-up forwards on rank r, then alternate forward and backward."""
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [f"F:{r}:{i}:-1" for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                order.append(f"F:{r}:{f}:-1")
                f += 1
            order.append(f"B:{r}:{b}:-1")
            b += 1
        out.append(order)
    return out
