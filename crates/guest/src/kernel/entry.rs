//! Everything that runs at CPL0, in assembly: the PVH ELF note, the 32-bit entry, the switch to
//! long mode, the TSS and IDT, kvmclock registration, the drop to the CPL3 workload, the
//! exception stubs and the halt gate.
//!
//! No compiler-generated code runs at CPL0. Under a page-table based hypervisor such as
//! kvm_pvm each CPL0 instruction is emulated by KVM, whose emulator lacks most SSE instructions
//! that Rust emits freely (a `xorps` at CPL0 ends the VM with "emulation failure"), and is
//! ~1000x slower anyway. So this file does only what needs CPL0, with instructions any
//! emulator handles, and leaves everything else (reading start_info, mapping RAM above 4 GiB,
//! formatting an exception report) to Rust at CPL3.
//!
//! Hand-off to Rust: `user_main(start_info)` at CPL3 with IOPL=3, interrupts off; on an
//! exception, `exception_report(&ExceptionFrame)` at CPL3 on a stack of its own.
//!
//! Secondary vCPUs: the boot vCPU's Rust code asks the VMM to start vCPU n at `ap_start32`
//! with %ebx = n (`ferry_guest_abi::smp`), once the page tables, GDT and IDT exist. Each vCPU
//! has its own TSS (GDT slots 5+2n), kernel and exception stacks, kvmclock page and user
//! stack; it enters long mode on the shared page tables and drops to `ap_main(n)` at CPL3.
//! Every per-vCPU thing is an array indexed by n, so nothing here is shared but read-only
//! tables and the exception report, which the first vCPU to fault takes.

core::arch::global_asm!(
    r#"
    /* PVH: ELF note type 18 (XEN_ELFNOTE_PHYS32_ENTRY), owner "Xen", descriptor = the 32-bit
       physical entry point. The word after the descriptor is zero so that loaders reading the
       descriptor as a 64-bit value (QEMU does) still get the right address. */
    .section .note.Xen, "a"
    .balign 4
    .long 4
    .long 4
    .long 18
    .asciz "Xen"
    .balign 4
    .long pvh_start32
    .long 0

    /* Long mode on the boot page tables, then a far jump to 64-bit code at \target. Clobbers
       %eax, %ecx, %edx. */
    .macro enter_long_mode target
    movl %cr4, %eax
    orl $0x620, %eax                /* PAE | OSFXSR | OSXMMEXCPT */
    movl %eax, %cr4
    movl $boot_pml4, %eax
    movl %eax, %cr3
    movl $0xc0000080, %ecx          /* EFER.LME */
    rdmsr
    orl $0x100, %eax
    wrmsr
    movl %cr0, %eax
    andl $0xfffffffb, %eax          /* clear EM */
    orl $0x80000022, %eax           /* PG | NE | MP */
    movl %eax, %cr0
    ljmpl $0x08, $\target
    .endm

    .macro flat_data_segments
    movl $0x10, %eax
    movl %eax, %ds
    movl %eax, %es
    movl %eax, %ss
    xorl %eax, %eax
    movl %eax, %fs
    movl %eax, %gs
    .endm

    .section .text.boot, "ax"
    .code32
    .global pvh_start32
pvh_start32:
    cli
    cld
    movl %ebx, %esi                 /* PVH: %ebx = start_info; kept in %esi */
    lgdtl gdt_pointer
    movl $0x10, %eax
    movl %eax, %ds
    movl %eax, %es
    movl %eax, %ss
    movl $boot_stack_top, %esp

    /* PML4[0] -> PDPT, PDPT[0..4] -> the four low page directories. */
    movl $boot_pdpt, %eax
    orl $0x7, %eax
    movl %eax, boot_pml4
    movl $boot_pd, %eax
    orl $0x7, %eax
    movl $boot_pdpt, %edi
    movl $4, %ecx
1:  movl %eax, (%edi)
    movl $0, 4(%edi)
    addl $4096, %eax
    addl $8, %edi
    loop 1b

    /* 2048 PDEs: frame i * 2 MiB, present | writable | user | large. */
    movl $boot_pd, %edi
    xorl %ecx, %ecx
2:  movl %ecx, %eax
    shll $21, %eax
    orl $0x87, %eax
    movl %eax, (%edi,%ecx,8)
    movl $0, 4(%edi,%ecx,8)
    incl %ecx
    cmpl $2048, %ecx
    jb 2b

    enter_long_mode long_mode_start

    .code64
long_mode_start:
    flat_data_segments
    leaq boot_stack_top(%rip), %rsp
    movl %esi, %r12d                /* start_info, kept in %r12 from here on */

    /* IDT: vectors 0-31 to the exception stubs, on IST1. */
    leaq idt(%rip), %rdi
    leaq exception_stubs(%rip), %rsi
    xorl %ecx, %ecx
5:  movq (%rsi,%rcx,8), %rax
    movl $0x8e, %edx
    call make_gate
    addq $16, %rdi
    incl %ecx
    cmpl $32, %ecx
    jb 5b
    /* The local APIC timer's vector and the spurious vector: interrupt gates on the current
       stack (IST 0). Interrupts are enabled only inside the sleep gate, at CPL0 on IST1, and
       an IST gate would restart that stack under the #GP frame. */
    leaq idt+{timer_vector}*16(%rip), %rdi
    leaq timer_interrupt(%rip), %rax
    movl $0x8e, %edx
    call make_gate
    movb $0, 4(%rdi)
    leaq idt+0xff*16(%rip), %rdi
    leaq spurious_interrupt(%rip), %rax
    call make_gate
    movb $0, 4(%rdi)
    xorl %r13d, %r13d               /* this is vCPU 0 */
    call cpu_setup

    /* Drop to CPL3: user_main(start_info) on the user stack, RFLAGS = IOPL3, IF = 0. */
    movl %r12d, %edi
    leaq user_stack_top-8(%rip), %rax
    leaq user_main(%rip), %rcx
    jmp enter_user

/* A secondary vCPU, started by the VMM at the boot vCPU's request (see the module comment):
   32-bit flat protected mode, %ebx = its index. The boot vCPU built every table it needs. */
    .code32
    .global ap_start32
ap_start32:
    cli
    cld
    lgdtl gdt_pointer
    enter_long_mode ap_long_mode

    .code64
ap_long_mode:
    flat_data_segments
    movl %ebx, %r13d
    leaq 1(%r13), %rax
    shlq $12, %rax
    leaq kernel_stacks(%rip), %rsp
    addq %rax, %rsp
    call cpu_setup
    /* ap_main(n) on its user stack, slot n of ap_user_stacks. */
    movl %r13d, %edi
    leaq 1(%r13), %rax
    shlq $15, %rax
    leaq ap_user_stacks-8(%rip), %rcx
    addq %rcx, %rax
    leaq ap_main(%rip), %rcx
    jmp enter_user

/* What every vCPU sets up for itself, vCPU %r13: its TSS (RSP0 and IST1 on its own stacks) in
   GDT slots 5+2n, the IDT, its GS base, and kvmclock on its own pvclock page. Clobbers every register but
   %r12, %r13 and %rsp. */
cpu_setup:
    movq %r13, %rdi
    shlq $7, %rdi
    leaq tss(%rip), %rax
    addq %rax, %rdi                 /* %rdi = this vCPU's TSS */
    leaq 1(%r13), %rax
    shlq $12, %rax
    leaq kernel_stacks(%rip), %rdx
    addq %rax, %rdx
    movq %rdx, 4(%rdi)              /* RSP0 */
    leaq exception_stacks(%rip), %rdx
    addq %rax, %rdx
    movq %rdx, 36(%rdi)             /* IST1 */
    movw $104, 102(%rdi)            /* I/O bitmap offset past the TSS: none (IOPL=3 suffices) */

    /* TSS descriptor: base = %rdi, limit = 103, type 0x89 (available). */
    movq %rdi, %rax
    movq %rax, %rdx
    andq $0xffffff, %rdx
    shlq $16, %rdx
    orq $103, %rdx
    movabsq $0x0000890000000000, %rcx
    orq %rcx, %rdx
    movq %rax, %rcx
    shrq $24, %rcx
    andq $0xff, %rcx
    shlq $56, %rcx
    orq %rcx, %rdx
    movq %r13, %rcx
    shlq $4, %rcx
    leaq gdt+40(%rip), %rsi
    addq %rcx, %rsi
    movq %rdx, (%rsi)
    shrq $32, %rax
    movq %rax, 8(%rsi)
    lidt idt_pointer(%rip)
    leal 0x28(%ecx), %eax
    ltr %ax

    /* GS base -> this vCPU's slot of vcpu_ids, which holds its index: how CPL3 code that was
       not handed the index (exception and panic reports) learns it, with `mov %gs:0`. */
    leaq vcpu_ids(%rip), %rax
    leaq (%rax,%r13,8), %rax
    movq %r13, (%rax)
    movq %rax, %rdx
    shrq $32, %rdx
    movl $0xc0000101, %ecx          /* IA32_GS_BASE */
    wrmsr

    /* kvmclock: if CPUID 0x40000000 says "KVMKVMKVM" and 0x40000001 has CLOCKSOURCE2 (bit 3),
       register this vCPU's pvclock page through MSR_KVM_SYSTEM_TIME_NEW. */
    movl $0x40000000, %eax
    xorl %ecx, %ecx
    cpuid
    cmpl $0x4b4d564b, %ebx
    jne 6f
    cmpl $0x564b4d56, %ecx
    jne 6f
    cmpl $0x4d, %edx
    jne 6f
    cmpl $0x40000001, %eax
    jb 6f
    movl $0x40000001, %eax
    xorl %ecx, %ecx
    cpuid
    testl $8, %eax
    jz 6f
    movl $0x4b564d01, %ecx
    movq %r13, %rax
    shlq $6, %rax
    leaq pvclock(%rip), %rdx
    addq %rdx, %rax
    orq $1, %rax
    xorl %edx, %edx
    wrmsr
    movl $1, kvmclock_enabled(%rip)
6:  ret

/* iretq to CPL3 at %rcx with stack %rax (already 8 below a 16-byte boundary, as after a call). */
enter_user:
    pushq $0x1b
    pushq %rax
    pushq $0x3002
    pushq $0x23
    pushq %rcx
    iretq

/* Writes the 16-byte interrupt gate at (%rdi) for handler %rax, type/attribute %dl, IST1. */
make_gate:
    movw %ax, (%rdi)
    movw $0x08, 2(%rdi)
    movb $1, 4(%rdi)
    movb %dl, 5(%rdi)
    movq %rax, %r8
    shrq $16, %r8
    movw %r8w, 6(%rdi)
    shrq $16, %r8
    movl %r8d, 8(%rdi)
    movl $0, 12(%rdi)
    ret

    /* Exception stubs: push a zero error code where the CPU pushes none, then the vector. */
    .macro exc_noerr n
exc_\n:
    pushq $0
    pushq $\n
    jmp exception_common
    .endm
    .macro exc_err n
exc_\n:
    pushq $\n
    jmp exception_common
    .endm

    exc_noerr 0
    exc_noerr 1
    exc_noerr 2
    exc_noerr 3
    exc_noerr 4
    exc_noerr 5
    exc_noerr 6
    exc_noerr 7
    exc_err 8
    exc_noerr 9
    exc_err 10
    exc_err 11
    exc_err 12
exc_13:
    jmp gp_handler
    exc_err 14
    exc_noerr 15
    exc_noerr 16
    exc_err 17
    exc_noerr 18
    exc_noerr 19
    exc_noerr 20
    exc_err 21
    exc_noerr 22
    exc_noerr 23
    exc_noerr 24
    exc_noerr 25
    exc_noerr 26
    exc_noerr 27
    exc_noerr 28
    exc_err 29
    exc_err 30
    exc_noerr 31

/* #GP: the CPL3 workload's three privileged needs.
   - Port I/O. IOPL=3 lets CPL3 use in/out, but a hypervisor that runs guest user code in
     hardware ring 3 with the host's IOPL (kvm_pvm does) raises #GP instead. For a #GP from
     CPL3 on one of the forms the workload uses (EC in al,dx; ED in eax,dx; EE out dx,al; EF
     out dx,eax) this performs the access on the user's %eax/%dx and resumes after the one-byte
     instruction, so the guest's code is the same on every host.
   - Halting. HLT (F4) at CPL3 always raises #GP; from CPL3 it means "stop the machine". (A
     software interrupt gate would be the textbook way, but kvm_pvm answers `int n` from guest
     user mode with #UD.)
   - Sleeping. `wrmsr` of IA32_TSC_DEADLINE (0F 30 with %ecx = 0x6e0) arms the local APIC
     timer and halts until it fires (the sleep gate below).
   Anything else is a real fault.
   Stack on entry: error, rip, cs, rflags, rsp, ss. */
gp_handler:
    testq $3, 16(%rsp)
    jz gp_fault
    pushq %rsi
    movq 16(%rsp), %rsi
    movzbl (%rsi), %esi
    cmpl $0xee, %esi
    je 10f
    cmpl $0xef, %esi
    je 11f
    cmpl $0xec, %esi
    je 12f
    cmpl $0xed, %esi
    je 13f
    cmpl $0xf4, %esi
    je halt_gate
    cmpl $0x0f, %esi
    je 15f
    popq %rsi
gp_fault:
    pushq $13
    jmp exception_common
10: outb %al, %dx
    jmp 14f
11: outl %eax, %dx
    jmp 14f
12: inb %dx, %al
    jmp 14f
13: inl %dx, %eax
14: popq %rsi
    addq $1, 8(%rsp)
    addq $8, %rsp
    iretq
    /* 0F 30 (wrmsr) of IA32_TSC_DEADLINE from CPL3: the sleep gate. Arm the local APIC timer
       with the user's %edx:%eax, halt with interrupts on until an interrupt (the timer, or one
       already pending: STI holds interrupts off until after the HLT has begun), then resume
       after the instruction. Any other wrmsr is a real fault. */
15: movq 16(%rsp), %rsi
    movzbl 1(%rsi), %esi
    cmpl $0x30, %esi
    jne 16f
    cmpl $0x6e0, %ecx
    jne 16f
    wrmsr
    sti
    hlt
    cli
    popq %rsi
    addq $2, 8(%rsp)
    addq $8, %rsp
    iretq
16: popq %rsi
    jmp gp_fault

/* Copy the frame (vector, error, rip, cs, rflags, rsp, ss) and CR2 to exception_frame, then
   report at CPL3 on the report stack. The first vCPU to fault owns the report (exception_seen
   holds its index + 1): an exception while it reports ends the machine on the spot; another
   vCPU's exception stops that vCPU quietly, so the owner's report is what the VMM sees. */
exception_common:
    movq %gs:0, %rdx
    incq %rdx
    xorl %eax, %eax
    lock cmpxchgq %rdx, exception_seen(%rip)
    jz 8f
    cmpq %rax, %rdx
    je 7f
9:  cli
    hlt
    jmp 9b
8:
    leaq exception_frame(%rip), %rdi
    popq %rax
    movq %rax, 0(%rdi)
    popq %rax
    movq %rax, 8(%rdi)
    popq %rax
    movq %rax, 16(%rdi)
    popq %rax
    movq %rax, 24(%rdi)
    popq %rax
    movq %rax, 32(%rdi)
    popq %rax
    movq %rax, 40(%rdi)
    popq %rax
    movq %rax, 48(%rdi)
    movq %cr2, %rax
    movq %rax, 56(%rdi)
    leaq report_stack_top-8(%rip), %rax
    leaq exception_report(%rip), %rcx
    jmp enter_user
7:  movw ${exit_port}, %dx
    outb %al, %dx
    cli
    hlt
    jmp 7b

/* The local APIC timer fired (only ever inside the sleep gate): acknowledge it (EOI at the
   xAPIC's default base, identity-mapped) and return into the gate. */
timer_interrupt:
    pushq %rax
    movl $0xfee000b0, %eax
    movl $0, (%rax)
    popq %rax
    iretq

/* A spurious interrupt needs no EOI. */
spurious_interrupt:
    iretq

    /* The end: reached from a CPL3 `hlt` through the #GP handler. The write to the exit port
       tells the VMM the guest is done: with an in-kernel interrupt controller a halted vCPU
       sleeps in KVM and the VMM would never see the HLT. */
halt_gate:
    movw ${exit_port}, %dx
    outb %al, %dx
    cli
    hlt
    jmp halt_gate

    .section .rodata
    .balign 8
    .global exception_stubs
exception_stubs:
    .quad exc_0, exc_1, exc_2, exc_3, exc_4, exc_5, exc_6, exc_7
    .quad exc_8, exc_9, exc_10, exc_11, exc_12, exc_13, exc_14, exc_15
    .quad exc_16, exc_17, exc_18, exc_19, exc_20, exc_21, exc_22, exc_23
    .quad exc_24, exc_25, exc_26, exc_27, exc_28, exc_29, exc_30, exc_31

    .section .data
    .balign 16
    .global gdt
gdt:
    .quad 0
    .quad 0x00af9a000000ffff        /* 0x08 kernel code, 64-bit */
    .quad 0x00cf92000000ffff        /* 0x10 kernel data */
    .quad 0x00cff2000000ffff        /* 0x18 user data, DPL 3 */
    .quad 0x00affa000000ffff        /* 0x20 user code, 64-bit, DPL 3 */
    .fill 2 * {max_vcpus}, 8, 0         /* 0x28 + 16n: vCPU n's TSS, filled in by cpu_setup */
gdt_end:
    .balign 8
gdt_pointer:
    .word gdt_end - gdt - 1
    .quad gdt
idt_pointer:
    .word 256 * 16 - 1
    .quad idt

    .section .bss
    .balign 4096
    .global boot_pml4
boot_pml4:  .skip 4096
    .global boot_pdpt
boot_pdpt:  .skip 4096
boot_pd:    .skip 4 * 4096
idt:        .skip 256 * 16
    .balign 64
    .global pvclock
pvclock:    .skip 64 * {max_vcpus}  /* per vCPU: pvclock_vcpu_time_info, written by the hypervisor */
    .global kvmclock_enabled
kvmclock_enabled: .skip 8
    .global exception_frame
exception_frame: .skip 64
exception_seen: .skip 8
vcpu_ids:   .skip 8 * {max_vcpus}
    /* 64-bit TSSs (Intel SDM vol. 3, 8.7), 128 bytes apart: RSP0 for CPL3 -> CPL0, IST1 for
       every gate. */
    .balign 128
tss:        .skip 128 * {max_vcpus}
    .balign 16
boot_stack: .skip 16384
boot_stack_top:
kernel_stacks: .skip 4096 * {max_vcpus}
exception_stacks: .skip 4096 * {max_vcpus}
report_stack: .skip 32768
report_stack_top:
user_stack: .skip 65536
user_stack_top:
    /* Secondary vCPUs' user stacks, 32 KiB each (slot 0 unused: vCPU 0 has user_stack). */
ap_user_stacks: .skip 32768 * {max_vcpus}
"#,
    exit_port = const ferry_guest_abi::EXIT_PORT,
    timer_vector = const super::timer::VECTOR,
    max_vcpus = const ferry_guest_abi::smp::MAX_VCPUS,
    options(att_syntax)
);
