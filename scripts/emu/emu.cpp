#include "emu.h"
EmuFiber* emu_cur;
EmuBlock* emu_blk;
std::vector<unsigned> emu_block_order;
unsigned emu_dynamic_smem = ~0u;

static void emu_entry() {
    emu_blk->body();
    if (!emu_cur->async.empty()) {
        fprintf(stderr, "emu: thread %u ended with cp.async copies it never waited for\n", emu_cur->tid.x);
        abort();
    }
    emu_cur->state = EMU_DONE;
    swapcontext(&emu_cur->ctx, &emu_blk->sched);
}

void emu_launch(emu_dim3 grid, unsigned block, const std::function<void()>& body) {
    static EmuBlock b;
    b.f.resize(block);
    for (auto& f : b.f)
        if (f.stack.empty()) f.stack.resize(256 << 10);
    b.bdim = {block, 1, 1};
    b.gdim = grid;
    b.body = body;
    emu_blk = &b;
    for (unsigned by = 0; by < grid.y; by++)
        for (unsigned ix = 0; ix < grid.x; ix++) {
            const bool ordered = grid.y == 1 && emu_block_order.size() == grid.x;
            const unsigned bx = ordered ? emu_block_order[ix] : ix;
            b.bid = {bx, by, 0};
            for (unsigned t = 0; t < block; t++) {
                EmuFiber& f = b.f[t];
                f.tid = {t, 0, 0};
                f.state = EMU_RUN;
                getcontext(&f.ctx);
                f.ctx.uc_stack.ss_sp = f.stack.data();
                f.ctx.uc_stack.ss_size = f.stack.size();
                f.ctx.uc_link = nullptr;
                makecontext(&f.ctx, emu_entry, 0);
            }
            for (;;) {
                for (auto& f : b.f)
                    if (f.state == EMU_RUN) {
                        emu_cur = &f;
                        swapcontext(&b.sched, &f.ctx);
                    }
                // Every live thread now waits at a barrier or is done.
                bool released = false, live = false;
                for (unsigned w = 0; w * 32 < block; w++) {
                    int n_live = 0, n_warp = 0, n_block = 0;
                    for (unsigned t = w * 32; t < block && t < w * 32 + 32; t++) {
                        const int s = b.f[t].state;
                        n_live += s != EMU_DONE;
                        n_warp += s == EMU_WARP;
                        n_block += s == EMU_BLOCK;
                    }
                    if (n_warp && n_block) {
                        fprintf(stderr, "emu: warp %u of block (%u,%u) diverged over barriers\n", w, bx, by);
                        abort();
                    }
                    if (n_warp && n_warp == n_live) {
                        for (unsigned t = w * 32; t < block && t < w * 32 + 32; t++) b.f[t].state = EMU_RUN;
                        released = true;
                    }
                    live |= n_live > 0;
                }
                if (released) continue;
                if (!live) break;
                // No warp barrier to release: all live threads wait at the block barrier.
                for (auto& f : b.f)
                    if (f.state == EMU_BLOCK) f.state = EMU_RUN;
                    else if (f.state != EMU_DONE) {
                        fprintf(stderr, "emu: deadlock in block (%u,%u)\n", bx, by);
                        abort();
                    }
            }
        }
}
