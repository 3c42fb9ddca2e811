"""Hand-made stage graphs and schedule orders shared by the planner and simulator tests."""
from dipc.plan import TensorSpec
from dipc.stages import Edge, Stage, StageGraph

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


def vlm_graph(p, images, b_i=12, vision_per_image=1.0, text_bytes=4.0, tf_v=0.2, tf_t=1.0, text_k=1):
    """A VLM step's stage graph on ``p`` ranks: per microbatch ``m`` with ``images[m]`` images, ceil(n / b_i)
    vision sub-microbatches flow through vision chunks 0..p-1 (chunk r on rank r), then the microbatch through text
    chunks p..(1 + text_k)p - 1, chunk c on rank c % p (needing every vision sub-microbatch); backwards in reverse.  Activation bytes: a vision stage
    keeps ``vision_per_image`` per image, a text stage ``text_bytes``; forward seconds ``tf_v`` per image and
    ``tf_t``, backward 2x."""
    import math
    stages, edges = {}, []

    def add(kind, c, mb, sub, lat, act, mod):
        s = Stage(kind, c, mb, sub, c % p, lat, priority=-mb, activation_bytes=act, modality=mod)
        stages[s.key] = s
        return s.key

    for mb, n in enumerate(images):
        subs = []
        m_i = math.ceil(n / b_i)
        sizes = [n // m_i + (1 if j < n % m_i else 0) for j in range(m_i)] if m_i else []
        for j, k in enumerate(sizes):
            for c in range(p):
                f = add("F", c, mb, j, tf_v * k, vision_per_image * k, "vision")
                b = add("B", c, mb, j, 2 * tf_v * k, vision_per_image * k, "vision")
                edges.append(Edge(f, b))
                if c:
                    edges.append(Edge(f"F:{c - 1}:{mb}:{j}", f, T))
                    edges.append(Edge(b, f"B:{c - 1}:{mb}:{j}", T))
            subs.append(j)
        for c in range(p, p + text_k * p):
            f = add("F", c, mb, -1, tf_t, text_bytes, "text")
            b = add("B", c, mb, -1, 2 * tf_t, text_bytes, "text")
            edges.append(Edge(f, b))
            if c > p:
                edges.append(Edge(f"F:{c - 1}:{mb}:-1", f, T))
                edges.append(Edge(b, f"B:{c - 1}:{mb}:-1", T))
            else:
                for j in subs:
                    edges.append(Edge(f"F:{p - 1}:{mb}:{j}", f, T))
                    edges.append(Edge(b, f"B:{p - 1}:{mb}:{j}", T))
    return StageGraph(stages, edges)
